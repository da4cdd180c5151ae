"""Gradient codecs for :func:`towers.allreduce.compressed`: fewer bytes on the wire.

A codec turns one variable's per-tower gradients into a (lossy) sum, moving data only
through a :class:`Wire` (so its bytes can be counted), as Horovod's ``compress`` /
``decompress``; :data:`CODECS` lists the built-in codecs with their payloads::

    tower t:  g_t ─encode(g_t, state_t)─▶ payload_t ──wire──▶ decode ─▶ Σ_t g_t (approx.)
                          └─▶ state_t' (e.g. the residual left out, added next step)

References:
    Horovod ``horovod.tensorflow.compression``; PyTorch ``ddp_comm_hooks``
    (``default_hooks.fp16_compress_hook``, ``powerSGD_hook``); Aji and Heafield 2017 and
    Lin et al. 2018 (top-k with error feedback); Vogels et al., NeurIPS 2019 (PowerSGD).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce
from towers.allreduce.machinery.packed import per_tower
from towers.allreduce.machinery.primitives import send
from towers.allreduce.machinery.registry import Record, Registry
from towers.allreduce.machinery.rounding import rounding, unit_roundoff

__all__ = ["CODECS", "Cast", "Codec", "Identity", "TopK", "TopKState", "Wire", "bf16", "fp16",
           "identity", "register_codec", "topk"]


@dataclasses.dataclass(frozen=True)
class Wire:
    """All a codec may use to talk to the other towers: the dense all-reduce ``algorithm``
    (``op="sum"``), gathers, and decoding on ``decoders`` (the rest get ``decoders[0]``'s)."""

    devices: tuple[str, ...]
    algorithm: AllReduce
    decoders: tuple[int, ...] = (0,)

    @property
    def towers(self) -> int:
        return len(self.devices)

    def all_reduce(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Sum ``values[tower]`` with the algorithm; output ``t`` on ``devices[t]``."""
        outs = list(self.algorithm(list(values), op="sum"))
        if len(outs) != len(values):
            raise ValueError(f"algorithm returned {len(outs)} outputs for {len(values)} values")
        return outs

    def per_tower(self, fn: Callable[[int], Any]) -> list[Any]:
        """``[fn(tower) for tower]``, each call under that tower's device (local work)."""
        return per_tower(self.devices, fn)

    def gather(self, values: Sequence[tf.Tensor], dst: int) -> list[tf.Tensor]:
        """Every tower's value on tower ``dst``, in tower order (one send per other tower)."""
        return [send(v, self.devices[dst], note="gather") for v in values]

    def decode(self, fn: Callable[[int], tf.Tensor]) -> list[tf.Tensor]:
        """Run ``fn(tower)`` on each decoder tower; copy decoder 0's result to the rest."""
        done = {}
        for t in self.decoders:
            with tf.device(self.devices[t]):
                done[t] = fn(t)
        first = done[self.decoders[0]]
        return [done[t] if t in done else send(first, d, note="decoded")
                for t, d in enumerate(self.devices)]


@runtime_checkable
class Codec(Protocol):
    """The contract of a codec: how one variable's per-tower gradients become one sum.

    One tower's state for one variable is a tuple of tensors (``()`` when stateless), kept
    by ``Compressed`` in checkpointed variables on that tower. A state field ``residual``
    (error feedback: what a tower has not sent yet, ``r`` old, ``r'`` new) keeps::

        output + Σ_t r'_t  ==  Σ_t (g_t + r_t)        within error_bound(Σ_t |g_t| + |r_t|)

    Optional formulas :func:`towers.testing.check_codec` checks: ``payload_bytes(shape,
    dtype) -> int`` (per tower and step) and ``error_bound(abs_sum, towers, depth)``.
    """

    def init(self, shape: tf.TensorShape, dtype: tf.DType, key: int) -> tuple[Any, ...]:
        """One tower's initial state for one variable (``key``: its index, a seed)."""
        ...

    def reduce(
        self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire
    ) -> tuple[list[tf.Tensor], list[Any]]:
        """``(outputs, new_states)``: ``tensors[tower]`` summed through ``wire``, each output
        on its tower's device and bitwise the same on every tower (``wire.decode``)."""
        ...


@dataclasses.dataclass(frozen=True)
class Identity:
    """No compression: the algorithm's all-reduce, decoded as is (the baseline)."""

    def init(self, shape: tf.TensorShape, dtype: tf.DType, key: int) -> tuple[()]:
        return ()

    def reduce(
        self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire
    ) -> tuple[list[tf.Tensor], list[Any]]:
        reduced = wire.all_reduce(tensors)
        return wire.decode(lambda t: reduced[t]), list(states)

    def payload_bytes(self, shape: tf.TensorShape, dtype: tf.DType) -> int:
        """The whole gradient: ``S`` bytes."""
        return int(tf.TensorShape(shape).num_elements()) * tf.as_dtype(dtype).size

    def error_bound(self, abs_sum: Any, towers: int, depth: int) -> np.ndarray:
        """The algorithm's own: ``γ_depth·Σ|g_t|`` (float32)."""
        return rounding(depth, abs_sum)


@dataclasses.dataclass(frozen=True)
class Cast:
    """Send ``x / n`` in a 16-bit float, sum it there, cast back up and multiply by ``n``.

    Dividing *before* the cast keeps the sum in range (float16 overflows at 65504), as
    DDP's ``fp16_compress_hook``. Error bound per element, for summation depth ``k``, ``u``
    the low precision's unit roundoff and ``u32`` = 2^-24::

        |out − Σ x_i| ≤ ((1 + u)^(k+1)·(1 + u32)² − 1)·Σ|x_i| + n²·η

    with ``η`` the error of rounding into the subnormals (2^-25 float16; 2^-126 bfloat16,
    whose subnormals float32 kernels flush), for ``|x_i|/n`` < 65504 in float16.
    """

    dtype: tf.DType

    def init(self, shape: tf.TensorShape, dtype: tf.DType, key: int) -> tuple[()]:
        return ()

    def reduce(
        self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire
    ) -> tuple[list[tf.Tensor], list[Any]]:
        """Encode ``cast(x / n)``, all-reduce, decode ``cast(sum, dtype) * n``."""
        n = wire.towers
        reduced = wire.all_reduce(wire.per_tower(
            lambda t: tf.cast(tensors[t] / tf.constant(n, tensors[t].dtype), self.dtype)))
        return wire.decode(
            lambda t: tf.cast(reduced[t], tensors[t].dtype) * tf.constant(n, tensors[t].dtype)
        ), list(states)

    def payload_bytes(self, shape: tf.TensorShape, dtype: tf.DType) -> int:
        """Every element in 16 bits: ``S/2`` for float32."""
        return int(tf.TensorShape(shape).num_elements()) * self.dtype.size

    def error_bound(self, abs_sum: Any, towers: int, depth: int) -> np.ndarray:
        """The bound above for ``abs_sum`` = Σ|x_i| (element-wise), as float64."""
        u, u32 = unit_roundoff(self.dtype), unit_roundoff(tf.float32)
        eta = 2.0**-25 if self.dtype == tf.float16 else 2.0**-126
        rel = (1 + u) ** (depth + 1) * (1 + u32) ** 2 - 1
        return rel * np.asarray(abs_sum, np.float64) + towers**2 * eta


class TopKState(NamedTuple):
    """One tower's top-k state: the residual not yet sent (added to the next gradient)."""

    residual: tf.Tensor


@dataclasses.dataclass(frozen=True)
class TopK:
    """Send each tower's largest-magnitude ``ratio`` of entries; feed the rest back.

    ``Δ = g + residual``; the ``k = ceil(ratio·size)`` (≥ 1) entries of largest ``|Δ|``
    go as ``(int32 indices, values)``, the rest stays as the residual. The decoder
    scatter-adds the gathered pairs in tower order; the algorithm is not used.
    """

    ratio: float

    def count(self, size: int) -> int:
        """How many entries of a ``size``-element tensor are sent."""
        return 0 if size == 0 else min(size, max(1, math.ceil(self.ratio * size)))

    def init(self, shape: tf.TensorShape, dtype: tf.DType, key: int) -> TopKState:
        return TopKState(tf.zeros(shape, dtype))

    def encode(
        self, tensor: tf.Tensor, state: TopKState
    ) -> tuple[tuple[tf.Tensor, tf.Tensor], TopKState]:
        """``((indices, values), TopKState(residual))`` for one tower."""
        delta = tf.reshape(tensor + state.residual, [-1])
        _, indices = tf.math.top_k(tf.abs(delta), self.count(int(delta.shape[0])))
        values = tf.gather(delta, indices)
        residual = tf.tensor_scatter_nd_update(delta, indices[:, None], tf.zeros_like(values))
        return (indices, values), TopKState(tf.reshape(residual, tf.shape(tensor)))

    def payload_bytes(self, shape: tf.TensorShape, dtype: tf.DType) -> int:
        """``k`` int32 indices and ``k`` values."""
        return self.count(int(tf.TensorShape(shape).num_elements())) * (4 + tf.as_dtype(dtype).size)

    def error_bound(self, abs_sum: Any, towers: int, depth: int) -> np.ndarray:
        """``γ_towers·Σ(|g_t| + |r_t|)``: ``Δ = g + r`` and the scatter-adds round."""
        return rounding(towers, abs_sum)

    def reduce(
        self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire
    ) -> tuple[list[tf.Tensor], list[Any]]:
        encoded = wire.per_tower(lambda t: self.encode(tensors[t], states[t]))
        indices = [payload[0] for payload, _ in encoded]
        values = [payload[1] for payload, _ in encoded]

        def decode(t: int) -> tf.Tensor:  # every tower's pairs scatter-added, in tower order
            pairs = zip(wire.gather(indices, t), wire.gather(values, t), strict=True)
            dense = tf.zeros([tensors[t].shape.num_elements()], tensors[t].dtype)
            for idx, val in pairs:
                dense = tf.tensor_scatter_nd_add(dense, idx[:, None], val)
            return tf.reshape(dense, tensors[t].shape)

        return wire.decode(decode), [state for _, state in encoded]


def identity() -> Identity:
    """The uncompressed baseline codec."""
    return Identity()


def fp16() -> Cast:
    """Pre-divide by the tower count and send float16 (DDP's ``fp16_compress_hook``)."""
    return Cast(tf.float16)


def bf16() -> Cast:
    """Pre-divide by the tower count and send bfloat16 (DDP's ``bf16_compress_hook``)."""
    return Cast(tf.bfloat16)


def topk(ratio: float = 0.01) -> TopK:
    """Send the largest ``ratio`` (in (0, 1]) of each gradient's entries, with error feedback."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
    return TopK(float(ratio))


CODECS = Registry(["codec"], [
    Record("identity", identity, kind="codec", summary="S per tower, exact (the baseline)"),
    Record("fp16", fp16, kind="codec", summary="S/2: x/n in float16, relative error"),
    Record("bf16", bf16, kind="codec", summary="S/2: x/n in bfloat16, relative error"),
    Record("topk", topk, kind="codec",
           summary="2·ratio·S (int32 index + value), gathered: top-k with error feedback"),
])
"""Every codec by name (payload per tower for S bytes); ``CODECS[name]()`` builds one."""

register_codec = CODECS.register
"""Add a codec's :class:`Record`: its name then works wherever a built-in codec's does."""
