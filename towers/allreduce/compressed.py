"""Compressed all-reduce: a codec around any algorithm, with checkpointable per-tower state.

A ``GradientReducer`` (PyTorch's communication hook, Horovod's compression): per variable
the codec (:mod:`towers.allreduce.codecs`) encodes, moves and decodes. n = 3::

    tower 0   g_0, s_0 ─encode─▶ payload_0 ─┐                      ┌─▶ out ─────────▶ out_0
    tower 1   g_1, s_1 ─encode─▶ payload_1 ─┼─ wire (all-reduce) ─▶│ decode once   ─send─▶ out_1
    tower 2   g_2, s_2 ─encode─▶ payload_2 ─┘                      │ on tower 0    ─send─▶ out_2
              s_t ◀── new state (error feedback, Q), written back to tower t's variables
                      only when the step is applied (commit; see below)

**Decode once** (the default) sends tower 0's dense result, ``(n-1)·S`` bytes, so outputs
are bitwise the same; ``decode="everywhere"`` decodes on every tower (fewer bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.codecs import Codec, Wire
from towers.allreduce.machinery.base import AllReduce
from towers.allreduce.machinery.packed import per_tower
from towers.allreduce.machinery.resolve import get, get_codec
from towers.devices import canonical_device
from towers.guard.arguments import check_choice

__all__ = ["DECODE", "Compressed", "compressed"]

DECODE = ("once", "everywhere")


class Compressed(tf.Module):
    """A gradient reducer through a codec; ``state[tower][var]``: the codec's state variables."""

    def __init__(self, algorithm: AllReduce, codec: Codec, decode: str = "once") -> None:
        super().__init__(name="compressed")
        self.algorithm = algorithm
        self.codec = codec
        self.decode = decode
        self.devices: list[str] = []
        self.state: list[list[tuple[tf.Variable, ...]]] = []
        self._templates: list[Any] = []

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        """Create the codec's state for ``variables``, one fresh copy per tower, eagerly."""
        if not tf.executing_eagerly():
            raise RuntimeError("Compressed.build must run eagerly, not inside tf.function")
        self.devices = [canonical_device(d) for d in devices]
        inits = per_tower(self.devices, lambda tower: [
            self.codec.init(v.shape, tf.as_dtype(v.dtype), j) for j, v in enumerate(variables)])
        self._templates = inits[0]
        self.state = per_tower(self.devices, lambda tower: [tuple(
            tf.Variable(x, trainable=False, name=f"tower{tower}_var{j}_{k}")
            for k, x in enumerate(init)) for j, init in enumerate(inits[tower])])

    def _read(self, tower: int, j: int) -> Any:
        with tf.device(self.devices[tower]):
            template, values = self._templates[j], [v.read_value() for v in self.state[tower][j]]
            return template._make(values) if hasattr(template, "_make") else tuple(values)

    def commit(self, new_state: Sequence[tf.Tensor]) -> None:
        """Assign ``new_state`` (from :meth:`reduce_deferred`), each on its tower's device."""
        flat = [(t, v) for t, row in enumerate(self.state) for var in row for v in var]
        if len(new_state) != len(flat):
            raise ValueError(f"expected {len(flat)} state values, got {len(new_state)}")
        for (tower, var), value in zip(flat, new_state):
            with tf.device(self.devices[tower]):
                var.assign(value)

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """``grads[tower][var]`` -> the codec's sums; updates the state (deferred, then commit)."""
        out, new_state = self.reduce_deferred(grads)
        self.commit(new_state)
        return out

    def reduce_deferred(
        self, grads: Sequence[Sequence[tf.Tensor]]
    ) -> tuple[list[list[tf.Tensor]], list[tf.Tensor]]:
        """``(out[tower][var], new_state)``: the codec's sums and the state's next values (as
        :meth:`commit` takes them); nothing is assigned."""
        if not self.devices:
            raise RuntimeError("call build(variables, devices) before reduce_gradients")
        n, count = len(self.devices), len(self._templates)
        if len(grads) != n or any(len(row) != count for row in grads):
            raise ValueError(f"expected grads[{n} towers][{count} variables]")
        decoders = (0,) if self.decode == "once" else tuple(range(n))
        wire = Wire(tuple(self.devices), self.algorithm, decoders)
        out: list[list[tf.Tensor]] = [[None] * count for _ in range(n)]
        new: list[list[Any]] = [[()] * count for _ in range(n)]
        for j in range(count):
            states = [self._read(t, j) for t in range(n)]
            outs, news = self.codec.reduce([row[j] for row in grads], states, wire)
            for t in range(n):
                out[t][j], new[t][j] = outs[t], news[t]
        return out, [value for row in new for var in row for value in var]


def compressed(
    algorithm: str | AllReduce = "ring", codec: str | Codec = "fp16", *, decode: str = "once"
) -> Compressed:
    """Reduce gradients through ``codec`` over ``algorithm``.

    Args:
        algorithm: a registry name or an all-reduce callable (``topk`` gathers instead).
        codec: a codec, a name in ``CODECS`` (``"topk(0.1)"`` passes arguments) or
            ``module:NAME``.
        decode: ``"once"`` (bitwise-identical outputs) or ``"everywhere"`` (fewer bytes).

    Raises:
        ValueError: an unknown algorithm or codec name, or a bad ``decode``.
        TypeError: ``algorithm`` is neither a name nor a callable.
    """
    check_choice("decode", decode, DECODE)
    return Compressed(get(algorithm), get_codec(codec), decode)
