"""PowerSGD: send a rank-r approximation of each gradient matrix, feed the rest back.

A gradient of shape ``[..., c]`` is viewed as an ``m × c`` matrix ``M`` (a Conv2D kernel
``[kh, kw, in, out]`` as ``[kh·kw·in, out]``); one power-iteration step finds a shared
rank-r basis. Per step, n towers, ``Q`` a ``c × r`` matrix the same on every tower::

    step  tower t (its device)                 wire                       shape
    1     Δ_t = M_t + e_t                      (error feedback)           m × c
    2     P_t = Δ_t · Q                                                   m × r
    3                                          P = all-reduce Σ_t P_t     m × r
    4     P̂ = orthogonalize(P)                 (decoders; sent to rest)   m × r
    5     Q_t = Δ_tᵀ · P̂                                                  c × r
    6     e_t' = Δ_t − P̂ · Q_tᵀ                (what this tower dropped)  m × c
    7                                          Q = all-reduce Σ_t Q_t     c × r
    8     out = P̂ · Qᵀ  = Σ_t P̂P̂ᵀΔ_t          (decoders; sent to rest)   m × c
    9     next step's Q = this Q               (warm start)

Bytes per tower: ``(m + c)·r`` elements instead of ``m·c``; ``out + Σ_t e_t' = Σ_t Δ_t``
up to rounding. ``Q`` starts as a normal draw from a seed every tower shares. Matrices too
small to gain (``(m + c)·r·min_compression_rate ≥ m·c``, as PyTorch) and vectors go
uncompressed. Error feedback follows the paper's Algorithm 2.

References:
    T. Vogels, S. P. Karimireddy and M. Jaggi, "PowerSGD: Practical Low-Rank Gradient
    Compression for Distributed Optimization", NeurIPS 2019. PyTorch
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from towers.allreduce.codecs import Identity, Wire, register_codec
from towers.allreduce.machinery.registry import Record
from towers.allreduce.machinery.rounding import rounding
from towers.guard.arguments import positive_int

__all__ = ["PowerSGD", "PowerSGDState", "orthogonalize", "powersgd"]

_SMALLEST_NORMAL = {
    tf.float16: 2.0**-14, tf.bfloat16: 2.0**-126, tf.float32: 2.0**-126, tf.float64: 2.0**-1022,
}


class PowerSGDState(NamedTuple):
    """One tower's state for one compressed matrix."""

    residual: tf.Tensor  # the variable's shape: what this tower has not sent yet
    q: tf.Tensor  # c × r: the projection for the next step, the same on every tower
    rng: tf.Tensor  # int64 [2]: stateless seed of the next fresh Q (warm_start=False)


def orthogonalize(p: tf.Tensor) -> tf.Tensor:
    """Orthonormalize the columns of ``p`` by modified Gram-Schmidt (zero columns stay zero).

    Example:
        >>> q = orthogonalize(tf.constant([[3.0, 1.0], [4.0, 1.0]]))   # q[:, 0] = [0.6, 0.8]
    """
    tiny = tf.constant(_SMALLEST_NORMAL[p.dtype], p.dtype)  # 0 / tiny = 0: no NaN
    cols: list[tf.Tensor] = []
    for i in range(int(p.shape[1])):
        col = p[:, i]
        for prev in cols:
            col = col - tf.reduce_sum(prev * col) * prev
        cols.append(col / tf.maximum(tf.norm(col), tiny))
    return tf.stack(cols, axis=1)


def _expand(p_hat: tf.Tensor, q: tf.Tensor, shape: Any) -> tf.Tensor:
    """``P̂·Qᵀ`` in ``shape`` (decompression)."""
    return tf.reshape(tf.matmul(p_hat, q, transpose_b=True), shape)


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """The PowerSGD codec; see the module docstring. Built by :func:`powersgd`."""

    rank: int
    warm_start: bool = True
    seed: int = 0
    min_compression_rate: float = 2.0

    def matrix(self, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """``(m, c, r)`` of a compressed shape, or ``None`` when it is sent uncompressed."""
        if len(shape) < 2:
            return None
        c = int(shape[-1])
        m = int(tf.TensorShape(shape).num_elements()) // max(c, 1)
        r = min(self.rank, m, c)
        if r == 0 or (m + c) * r * self.min_compression_rate >= m * c:
            return None
        return m, c, r

    def payload_bytes(self, shape: tf.TensorShape, dtype: tf.DType) -> int:
        """``(m + c)·r`` elements (P and Q), or the whole ``S`` when sent uncompressed."""
        dims, size = self.matrix(list(shape)), tf.as_dtype(dtype).size
        if dims is None:
            return int(tf.TensorShape(shape).num_elements()) * size
        m, c, r = dims
        return (m + c) * r * size

    def error_bound(self, abs_sum: Any, towers: int, depth: int) -> np.ndarray:
        """Rounding of ``out + Σ e' = Σ Δ``, float32: one ``P̂`` (orthonormal) builds both
        sides, so what rounds are the matmuls (``m``, ``r`` terms), the all-reduce (``depth``)
        and ``Δ = g + e``: ``2·γ_{m+r+depth+3}·(|Δ| + ‖Δ‖)``, ``‖·‖`` the Frobenius norm."""
        abs_sum = np.asarray(abs_sum, np.float64)
        dims = self.matrix(list(abs_sum.shape))
        if dims is None:
            return rounding(depth + 1, abs_sum)
        m, _, r = dims
        return 2 * rounding(m + r + depth + 3, abs_sum + np.sqrt(np.sum(abs_sum**2)))

    def _draw(self, rng: tf.Tensor, c: int, r: int, dtype: tf.DType) -> tf.Tensor:
        return tf.random.stateless_normal([c, r], seed=rng, dtype=dtype)

    def init(self, shape: tf.TensorShape, dtype: tf.DType, key: int) -> PowerSGDState | tuple[()]:
        dims = self.matrix(list(shape))
        if dims is None:
            return ()
        _, c, r = dims
        rng = tf.constant([self.seed, key], tf.int64)  # shared by every tower: same Q
        return PowerSGDState(tf.zeros(shape, dtype), self._draw(rng, c, r, dtype), rng)

    def reduce(
        self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire
    ) -> tuple[list[tf.Tensor], list[Any]]:
        dims = self.matrix(tensors[0].shape.as_list())
        if dims is None:  # a vector or a small matrix: exact, like the plain algorithm
            return Identity().reduce(tensors, states, wire)
        m, c, r = dims
        shape = tensors[0].shape
        deltas = wire.per_tower(lambda t: tf.reshape(tensors[t] + states[t].residual, [m, c]))
        p = wire.all_reduce(wire.per_tower(lambda t: tf.matmul(deltas[t], states[t].q)))
        p_hat = wire.decode(lambda t: orthogonalize(p[t]))
        qs = wire.per_tower(lambda t: tf.matmul(deltas[t], p_hat[t], transpose_a=True))
        errors = wire.per_tower(lambda t: deltas[t] - _expand(p_hat[t], qs[t], [m, c]))
        q = wire.all_reduce(qs)
        outs = wire.decode(lambda t: _expand(p_hat[t], q[t], shape))
        return outs, wire.per_tower(
            lambda t: self._next(states[t], tf.reshape(errors[t], shape), q[t], c, r)
        )

    def _next(self, state: PowerSGDState, error: tf.Tensor, q: tf.Tensor, c: int, r: int
              ) -> PowerSGDState:
        if self.warm_start:
            return PowerSGDState(error, q, state.rng)
        rng = tf.random.experimental.stateless_split(state.rng, 1)[0]
        return PowerSGDState(error, self._draw(rng, c, r, q.dtype), rng)


def powersgd(rank: int = 1, warm_start: bool = True, seed: int = 0,
             min_compression_rate: float = 2.0) -> PowerSGD:
    """Rank-``rank`` PowerSGD with error feedback; ``warm_start`` reuses last step's ``Q``
    (else a fresh draw), ``seed`` draws the first ``Q``.

    Raises:
        ValueError: ``rank`` < 1 or not an int, or ``min_compression_rate`` < 1.
    """
    rank = positive_int("rank", rank)
    if not min_compression_rate >= 1:
        raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate!r}")
    return PowerSGD(rank, bool(warm_start), int(seed), float(min_compression_rate))


register_codec(Record("powersgd", powersgd, kind="codec",
                      summary="(m + c)·r per m×c matrix, all-reduced: rank-r power step"))
