"""Compressed all-reduce: a codec around any algorithm, with checkpointable per-tower state.

``compressed(algorithm, codec)`` is a :class:`~towers.allreduce.base.GradientReducer`
(what PyTorch calls a communication hook and Horovod a compression): for every
variable it hands the towers' gradients and states to the codec, which encodes them
on each tower, moves the payloads over a :class:`~towers.allreduce.codecs.Wire` (the
algorithm's all-reduce, or gathers) and decodes a dense sum. n = 3, one variable::

    tower 0   g_0, s_0 ─encode─▶ payload_0 ─┐                      ┌─▶ out ─────────▶ out_0
    tower 1   g_1, s_1 ─encode─▶ payload_1 ─┼─ wire (all-reduce) ─▶│ decode once   ─send─▶ out_1
    tower 2   g_2, s_2 ─encode─▶ payload_2 ─┘                      │ on tower 0    ─send─▶ out_2
              s_t ◀── new state (error feedback, Q), written back to tower t's variables

**Decode once** (the default): only tower 0 decodes; the others receive its dense
result by :func:`~towers.allreduce.primitives.send`, so every tower's output is bitwise
the same whatever the kernels do (a matmul's blocking may depend on alignment). That
costs ``(n-1)·S`` dense bytes from tower 0. ``decode="everywhere"`` lets every tower
decode its own (identical) payload instead: the bytes stay compressed, and identical
outputs then rest on deterministic kernels (the tests check them on CPU).

State is created eagerly in :meth:`Compressed.build`, one copy per tower on that
tower's device, as ``tf.Variable`` s tracked by this ``tf.Module``, so
``tf.train.Checkpoint(reducer=...)`` saves and restores it with the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.base import AllReduce
from towers.allreduce.codecs import Codec, Wire, bf16, fp16, identity, topk
from towers.allreduce.powersgd import powersgd
from towers.allreduce.registry import Record, Registry
from towers.devices import canonical_device

__all__ = ["CODECS", "DECODE", "Compressed", "compressed", "get_codec"]

DECODE = ("once", "everywhere")

CODECS = Registry(["codec"], [
    Record("identity", identity, kind="codec", summary="S per tower, exact (the baseline)"),
    Record("fp16", fp16, kind="codec", summary="S/2: x/n in float16"),
    Record("bf16", bf16, kind="codec", summary="S/2: x/n in bfloat16"),
    Record("topk", topk, kind="codec", summary="2·ratio·S: top-k with error feedback"),
    Record("powersgd", powersgd, kind="codec",
           summary="(m + c)·r per m×c matrix: rank-r power step with error feedback"),
])
"""Every codec by name (:class:`~towers.allreduce.registry.Record` s of kind ``codec``),
filled here, in one place; ``CODECS[name]()`` builds it with its default settings."""


def get_codec(codec: str | Codec) -> Codec:
    """Resolve a codec name (``CODECS``) or pass a codec through.

    Raises:
        ValueError: an unknown name, or an object without ``init`` and ``reduce``.
    """
    if isinstance(codec, str):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; known: {', '.join(sorted(CODECS))}")
        built: Codec = CODECS[codec]()
        return built
    if not isinstance(codec, Codec):
        raise ValueError(f"codec must be a name or have init() and reduce(), got {codec!r}")
    return codec


def _make(template: Any, values: Sequence[Any]) -> Any:
    """Rebuild a state of ``template``'s type (a NamedTuple or a plain tuple) from values."""
    return template._make(values) if hasattr(template, "_make") else tuple(values)


class Compressed(tf.Module):
    """A gradient reducer that compresses each gradient with a codec. See :func:`compressed`.

    Attributes:
        state: ``state[tower][var]``, the codec's state variables (a tuple per variable,
            empty for stateless codecs); empty before :meth:`build`.
        devices: the towers' devices, set by :meth:`build`.
    """

    def __init__(self, algorithm: AllReduce, codec: Codec, decode: str = "once") -> None:
        super().__init__(name="compressed")
        self.algorithm = algorithm
        self.codec = codec
        self.decode = decode
        self.devices: list[str] = []
        self.state: list[list[tuple[tf.Variable, ...]]] = []
        self._templates: list[Any] = []

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        """Create the codec's state for ``variables``, one copy per tower on its device.

        Calling it again starts from fresh state.

        Raises:
            RuntimeError: called inside a ``tf.function`` (variables must be created eagerly).
        """
        if not tf.executing_eagerly():
            raise RuntimeError("Compressed.build must run eagerly, not inside tf.function")
        self.devices = [canonical_device(d) for d in devices]
        templates, state = [], []
        for tower, device in enumerate(self.devices):
            row = []
            with tf.device(device):
                for j, v in enumerate(variables):
                    init = self.codec.init(v.shape, tf.as_dtype(v.dtype), j)
                    row.append(tuple(
                        tf.Variable(x, trainable=False, name=f"tower{tower}_var{j}_{k}")
                        for k, x in enumerate(init)
                    ))
                    if tower == 0:
                        templates.append(init)
            state.append(row)
        self._templates = templates
        self.state = state

    def _read(self, tower: int, j: int) -> Any:
        with tf.device(self.devices[tower]):
            return _make(self._templates[j], [v.read_value() for v in self.state[tower][j]])

    def _write(self, tower: int, j: int, new: Any) -> None:
        with tf.device(self.devices[tower]):
            for var, value in zip(self.state[tower][j], new):
                var.assign(value)

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """``grads[tower][var]`` -> the codec's sums ``out[tower][var]``; updates the state.

        Raises:
            RuntimeError: :meth:`build` has not run.
            ValueError: the tower or variable count differs from :meth:`build`'s.
        """
        if not self.devices:
            raise RuntimeError("call build(variables, devices) before reduce_gradients")
        n, count = len(self.devices), len(self._templates)
        if len(grads) != n or any(len(row) != count for row in grads):
            raise ValueError(f"expected grads[{n} towers][{count} variables]")
        decoders = (0,) if self.decode == "once" else tuple(range(n))
        wire = Wire(tuple(self.devices), self.algorithm, decoders)
        out: list[list[tf.Tensor]] = [[None] * count for _ in range(n)]
        for j in range(count):
            states = [self._read(t, j) for t in range(n)]
            outs, new = self.codec.reduce([row[j] for row in grads], states, wire)
            for t in range(n):
                out[t][j] = outs[t]
                self._write(t, j, new[t])
        return out


def compressed(
    algorithm: str | AllReduce = "ring", codec: str | Codec = "fp16", *, decode: str = "once"
) -> Compressed:
    """Reduce gradients through ``codec`` over ``algorithm``.

    Args:
        algorithm: a registry name (``towers.ALGORITHMS``) or an all-reduce callable,
            used for the codec's dense exchanges (``topk`` gathers and does not use it).
        codec: a codec (``fp16()``, ``bf16()``, ``topk(ratio)``, ``powersgd(rank)``,
            ``identity()``) or one of their names in ``CODECS`` (default settings).
        decode: ``"once"`` (tower 0 decodes and sends the result: bitwise-identical
            outputs) or ``"everywhere"`` (each tower decodes: fewer bytes).

    Returns:
        A :class:`Compressed` reducer for ``TowerTrainer(all_reduce=...)``.

    Raises:
        ValueError: an unknown algorithm or codec name, or a bad ``decode``.
        TypeError: ``algorithm`` is neither a name nor a callable.

    Example:
        >>> reducer = compressed("ring", powersgd(2))                   # doctest: +SKIP
        >>> trainer = towers.TowerTrainer(..., all_reduce=reducer)       # doctest: +SKIP
        >>> tf.train.Checkpoint(model=trainer.model, reducer=reducer).save(path)  # +SKIP
    """
    from towers.allreduce import get  # the registry imports this module

    if decode not in DECODE:
        raise ValueError(f"decode must be one of {', '.join(DECODE)}; got {decode!r}")
    if isinstance(codec, str) and codec not in CODECS:
        raise ValueError(f"codec: unknown codec {codec!r}; known: {', '.join(sorted(CODECS))}")
    return Compressed(get(algorithm), get_codec(codec), decode)
