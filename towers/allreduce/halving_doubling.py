"""Rabenseifner's all-reduce: reduce-scatter by recursive halving, all-gather by recursive doubling.

With p = 2^⌊log2 n⌋ active towers and r = n − p extra ones, n = 6 (p = 4, r = 2),
the buffer padded to p chunks c0..c3 (``→ t`` sends to tower t)::

    tick:    0 fold-in   1 halve d=2    2 halve d=1   3 double d=1   4 double d=2   5 fold-out
    tower 0  x0 += x4    c2c3 → t2      c1 → t1       c0 → t1        c0c1 → t2      out → t4
    tower 1  x1 += x5    c2c3 → t3      c0 → t0       c1 → t0        c0c1 → t3      out → t5
    tower 2              c0c1 → t0      c3 → t3       c2 → t3        c2c3 → t0
    tower 3              c0c1 → t1      c2 → t2       c3 → t2        c2c3 → t1
    tower 4  x4 → t0     (sits out)                                                 ◀── out
    tower 5  x5 → t1     (sits out)                                                 ◀── out

Index formula (towers i < p; h = log2 p): halving step k = 0..h−1 has distance
d = p / 2^(k+1) and partner i XOR d. Before it, tower i owns the 2d chunks from
i − i mod 2d; it keeps the d chunks from i − i mod d (the half holding chunk i),
sends the other d and combines what it gets, so after h steps it owns chunk i
fully reduced (the lower tower's data always on the left of the op). Doubling
runs d = 1, 2, …, p/2: tower i sends its d chunks to i XOR d and both
concatenate. Extra tower p + j folds its whole vector into tower j first and gets
the result from it last. Chunk i is finished (``mean`` divides) once, on tower i.

Padding: the flattened length L is zero-padded to p·⌈L/p⌉ (TF's own builder
refuses lengths not divisible by 2^h and non-power-of-two counts); the fold
messages carry the unpadded L elements.

Cost (S bytes; f = 1 when r > 0 else 0):
(2·log2 p + 2f)·α + (2(p−1)/p + 2f)·Sβ + ((p−1)/p + f)·Sγ. Every element goes
through ⌈log2 n⌉ additions.

References:
    Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
    Operations in MPICH", IJHPCA 19(1), 2005; Rabenseifner, "Optimization of
    Collective Reduction Operations", ICCS 2004.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.base import AllReduce, check_values, combine, finish
from towers.allreduce.primitives import send
from towers.allreduce.registry import Algorithm, Coefficients, Configured, register, schedule_of
from towers.guard.arguments import positive_int

__all__ = ["HALVING_DOUBLING", "bytes_sent", "cost", "halving_doubling", "summation_depth"]


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _chunk_len(length: int, p: int) -> int:
    return -(-length // p)


def _static_length(value: tf.Tensor) -> int:
    if not value.shape.is_fully_defined():
        raise ValueError(f"halving_doubling needs a fully defined static shape, got {value.shape}")
    return int(value.shape.num_elements())


def _fold_in(flat: list[tf.Tensor], devices: Sequence[str], p: int, op: str) -> list[tf.Tensor]:
    """Extra tower p + j sends its whole vector to tower j, which combines it (tick 0)."""
    active = list(flat[:p])
    for extra in range(p, len(flat)):
        j = extra - p
        with tf.device(devices[j]):
            received = send(flat[extra], devices[j], tick=0, chunk=None, note="fold-in")
            active[j] = combine(active[j], received, op)
    return active


def _reduce_scatter(
    owned: list[tf.Tensor], devices: Sequence[str], chunk: int, op: str, tick: int
) -> list[tf.Tensor]:
    """Recursive halving: afterwards ``owned[i]`` is chunk i, combined over all towers."""
    p = len(owned)
    d = p // 2
    while d >= 1:
        half = d * chunk
        outgoing = []
        for i in range(p):
            with tf.device(devices[i]):
                give = owned[i][half:] if i & d == 0 else owned[i][:half]
                first = (i - i % (2 * d)) + (d if i & d == 0 else 0)
                outgoing.append(send(give, devices[i ^ d], tick=tick, chunk=first, note="halve"))
        kept = []
        for i in range(p):
            with tf.device(devices[i]):
                if i & d == 0:
                    kept.append(combine(owned[i][:half], outgoing[i ^ d], op))
                else:
                    kept.append(combine(outgoing[i ^ d], owned[i][half:], op))
        owned, d, tick = kept, d // 2, tick + 1
    return owned


def _all_gather(owned: list[tf.Tensor], devices: Sequence[str], tick: int) -> list[tf.Tensor]:
    """Recursive doubling: tower i sends its d owned chunks to i XOR d; both concatenate."""
    p = len(owned)
    d = 1
    while d < p:
        incoming = []
        for i in range(p):
            start = i - i % d
            incoming.append(send(owned[i], devices[i ^ d], tick=tick, chunk=start, note="double"))
        joined = []
        for i in range(p):
            with tf.device(devices[i]):
                mine, theirs = owned[i], incoming[i ^ d]
                joined.append(tf.concat([mine, theirs] if i & d == 0 else [theirs, mine], 0))
        owned, d, tick = joined, d * 2, tick + 1
    return owned


def _all_reduce(values: Sequence[tf.Tensor], op: str) -> list[tf.Tensor]:
    devices = check_values(values, op)
    n, p = len(values), _floor_pow2(len(values))
    shape, length = values[0].shape, _static_length(values[0])
    chunk = _chunk_len(length, p)
    flat = []
    for v, dev in zip(values, devices, strict=True):
        with tf.device(dev):
            flat.append(tf.reshape(v, [-1]))
    active = _fold_in(flat, devices, p, op)
    padded = []
    for i in range(p):
        with tf.device(devices[i]):
            padded.append(tf.pad(active[i], [[0, p * chunk - length]]))
    tick = 1 if n > p else 0
    owned = _reduce_scatter(padded, devices, chunk, op, tick)
    for i in range(p):
        with tf.device(devices[i]):
            owned[i] = finish(owned[i], op, n)
    tick += p.bit_length() - 1
    full = _all_gather(owned, devices, tick)
    tick += p.bit_length() - 1
    outputs: list[tf.Tensor] = []
    for i, dev in enumerate(devices):
        source = i if i < p else i - p
        with tf.device(devices[source]):
            result = tf.reshape(full[source][:length], shape)
        outputs.append(send(result, dev, tick=tick, chunk=None, note="fold-out"))
    return outputs


def _build() -> AllReduce:
    def halving_doubling_all_reduce(
        values: Sequence[tf.Tensor], *, op: str = "sum"
    ) -> list[tf.Tensor]:
        return _all_reduce(values, op)

    return halving_doubling_all_reduce


def halving_doubling() -> Configured:
    """Build Rabenseifner's halving-doubling all-reduce for any tower count and any length.

    Returns:
        The configured algorithm ``(values, *, op="sum") -> list[tf.Tensor]``; its
        ``bytes_sent`` and ``summation_depth`` give this module's formulas.

    Raises:
        ValueError: (when called) bad values (see ``check_values``) or a shape that
            is not fully defined.

    Example:
        >>> algo = halving_doubling()                              # doctest: +SKIP
        >>> outs = algo([tf.ones([5]) for _ in range(3)], op="mean")  # doctest: +SKIP
    """
    return HALVING_DOUBLING()


def bytes_sent(n: int, nbytes: int, itemsize: int) -> list[int]:
    """Exact bytes each tower sends through ``send`` for one all-reduce of ``nbytes`` per tower.

    With p = 2^⌊log2 n⌋, L = nbytes / itemsize and c = ⌈L/p⌉ (padded chunk
    length): tower i < p sends 2(p−1)·c·itemsize, plus nbytes more when i < n − p
    (fold-out); tower p + j sends nbytes (fold-in).

    Example:
        >>> bytes_sent(3, 20, 4)   # L = 5, p = 2, c = 3
        [44, 24, 20]
    """
    if n < 1 or itemsize < 1 or nbytes < 0 or nbytes % itemsize:
        raise ValueError(
            f"need n >= 1 and nbytes a multiple of itemsize; got {n}, {nbytes}, {itemsize}"
        )
    p = _floor_pow2(n)
    core = 2 * (p - 1) * _chunk_len(nbytes // itemsize, p) * itemsize
    return [core + (nbytes if i < n - p else 0) for i in range(p)] + [nbytes] * (n - p)


def summation_depth(n: int) -> int:
    """The most additions any result element goes through: ⌈log2 n⌉ (fold-in + log2 p halvings).

    Example:
        >>> summation_depth(6)
        3
    """
    return (positive_int("n", n) - 1).bit_length()


def cost(n: int, nbytes: float) -> Coefficients:
    """α-β-γ coefficients: ``(2h + 2f)·α + (2(p-1)/p + 2f)·S·β + ((p-1)/p + f)·S·γ``."""
    h = n.bit_length() - 1
    p = 1 << h
    a, b, c = 2 * h, 2 * (p - 1) / p * nbytes, (p - 1) / p * nbytes
    if n > p:  # fold in (send S, partner adds) and fold out (receive S)
        a, b, c = a + 2, b + 2 * nbytes, c + nbytes
    return a, b, c


HALVING_DOUBLING = register(
    Algorithm("halving_doubling", _build, bytes_sent, summation_depth, cost, schedule_of(__doc__))
)
