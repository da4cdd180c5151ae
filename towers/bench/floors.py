"""The floor of a chunked all-reduce on one host: the two parts any schedule must run.

::

    chunk adds:  tick t, tower i:  rows_i[c] + rows_{i-1}[c],  c = (i - t) mod n
                 n(n-1) two-input additions of S/n bytes (a ring's reduce-scatter)
    assembly:    concat(chunk 0 from tower 0, …, chunk n-1 from tower n-1), as the
                 schedules' outputs are put together (packed.assemble): one S-byte
                 write per tower, or one in all where the towers share one memory

Whatever the schedule (ring, swing, bruck, pat, torus_2d, halving-doubling), every element
goes through its n - 1 additions on some tower and the output is written from the
chunks; naive does neither (its last addition writes the sum, and a copy between logical
CPUs passes a pointer). ``towers bench`` times both beside the algorithms as calibration
rows and :mod:`towers.bench.targets` sets each chunked schedule against their sum.
"""

from __future__ import annotations

import tensorflow as tf

from towers import allreduce
from towers.allreduce.machinery.packed import assemble, pad_rows

__all__ = ["ADDS", "ASSEMBLY", "assembly", "chunk_adds"]

ADDS, ASSEMBLY = "chunk adds", "assembly"


def chunk_adds(values: list[tf.Tensor]) -> list[tf.Tensor]:
    """A ring reduce-scatter's arithmetic: at tick t tower i adds chunk (i - t) mod n of
    its own rows to the one tower i - 1 sends (pointers on one host): n(n-1) adds."""
    n = len(values)
    rows = [pad_rows(v, n)[0] for v in values]
    out = []
    for t in range(n - 1):
        for i, v in enumerate(values):
            c = (i - t) % n
            with tf.device(v.device):
                out.append(allreduce.send(rows[i - 1][c:c + 1], v.device) + rows[i][c:c + 1])
    return out


def assembly(values: list[tf.Tensor]) -> list[tf.Tensor]:
    """The outputs written from n finished chunks, chunk c held by tower c, as the chunked
    schedules write theirs (:func:`~towers.allreduce.machinery.packed.assemble`)."""
    n = len(values)
    rows = [pad_rows(v, n)[0] for v in values]
    devices = [v.device for v in values]
    held = []
    for v in values:
        with tf.device(v.device):
            held.append([allreduce.send(rows[c][c:c + 1], v.device) for c in range(n)])
    return assemble(held, devices, lambda tower: tf.concat(held[tower], 0))
