"""The floor of a chunked all-reduce on one host: the two parts any schedule must run.

::

    chunk adds:  tick t, tower i:  rows_i[c] + rows_{i-1}[c],  c = (i - t) mod n
                 n(n-1) two-input additions of S/n bytes (a ring's reduce-scatter)
    assembly:    tower i:  concat(chunk 0 from tower 0, …, chunk n-1 from tower n-1)
                 one S-byte output per tower, written from the n finished chunks

Whatever the schedule (ring, swing, bruck, pat, torus_2d, halving-doubling), every element
goes through its n - 1 additions on some tower and every tower's output is written from
its chunks; naive does neither (its one sum is shared, a copy between logical CPUs passes
a pointer). ``towers bench`` times both beside the algorithms as calibration rows and
:mod:`towers.bench.targets` sets each chunked schedule against their sum.
"""

from __future__ import annotations

import tensorflow as tf

from towers import allreduce
from towers.allreduce.machinery.packed import pad_rows

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
    """Every tower's output written from n finished chunks, chunk c held by tower c."""
    n = len(values)
    rows = [pad_rows(v, n)[0] for v in values]
    out = []
    for v in values:
        with tf.device(v.device):
            out.append(tf.concat([allreduce.send(rows[c][c:c + 1], v.device)
                                  for c in range(n)], 0))  # fmt: skip
    return out
