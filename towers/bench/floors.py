"""The floor of a chunked all-reduce on one host: the parts any schedule must run.

::

    leaf adds:   tick t, tower i:  rows_i[c] + rows_{i-1}[c],  c = (i - t) mod n
                 n(n-1) two-input additions of S/n bytes, each of two towers' own
                 chunks: every one writes a new buffer
    chain adds:  the same additions in a ring's order, each on the partial the one
                 before it made: chunk c = ((rows_a[c] + rows_b[c]) + rows_d[c]) + …
                 one new buffer per chunk; TensorFlow writes every later addition into
                 the partial it consumes (the kernel forwards its input buffer)
    assembly:    concat(chunk 0 from tower 0, …, chunk n-1 from tower n-1), as the
                 schedules' outputs are put together (packed.assemble): one S-byte
                 write per tower, or one in all where the towers share one memory

Whatever the schedule (ring, swing, bruck, pat, torus_2d, halving-doubling), every element
goes through its n - 1 additions on some tower and the output is written from the
chunks; naive does the additions as a chain on one device and no assembly (its last
addition writes the sum, and a copy between logical CPUs passes a pointer).

What a schedule's additions cost on one memory depends on the shape of each chunk's
reduction tree. An addition whose operands are both towers' own chunks (a *leaf* of the
tree: both are slices of the inputs, which TensorFlow never overwrites) writes a new
buffer, which the CPU must first read into its cache; an addition that consumes a
partial writes into it. A ring's chunk is a chain, one leaf of ``n - 1`` additions; a
log-step schedule's is a balanced tree, ``n/2`` leaves (:func:`leaf_share`). The two
calibration rows time both extremes with the same additions, so
:func:`in_sequence` prices any schedule's additions, and ``towers bench`` sets each
chunked schedule beside its parts (:mod:`towers.bench.targets`).
"""

from __future__ import annotations

import tensorflow as tf

from towers import allreduce
from towers.allreduce.machinery.packed import assemble, pad_rows
from towers.schedule.ir import Schedule

__all__ = [
    "ASSEMBLY", "CHAIN_ADDS", "LEAF_ADDS", "assembly", "chain_adds", "in_sequence",
    "leaf_adds", "leaf_share",
]

LEAF_ADDS, CHAIN_ADDS, ASSEMBLY = "leaf adds", "chain adds", "assembly"


def leaf_adds(values: list[tf.Tensor]) -> list[tf.Tensor]:
    """A ring reduce-scatter's arithmetic, every addition a leaf: at tick t tower i adds
    chunk (i - t) mod n of its own rows to tower i - 1's (pointers on one host): n(n-1)
    additions, each writing a new buffer."""
    n = len(values)
    rows = [pad_rows(v, n)[0] for v in values]
    out = []
    for t in range(n - 1):
        for i, v in enumerate(values):
            c = (i - t) % n
            with tf.device(v.device):
                out.append(allreduce.send(rows[i - 1][c:c + 1], v.device) + rows[i][c:c + 1])
    return out


def chain_adds(values: list[tf.Tensor]) -> list[tf.Tensor]:
    """The same n(n-1) additions as :func:`leaf_adds`, chained as a ring's reduce-scatter
    chains them: tower i adds its own chunk to the partial tower i - 1 sends. Returns
    the n finished chunks (chunk c's sum in the ring's order, as ``ring`` forms it)."""
    n = len(values)
    rows = [pad_rows(v, n)[0] for v in values]
    partial: dict[int, tf.Tensor] = {}
    for t in range(n - 1):
        for i, v in enumerate(values):
            c = (i - t) % n
            left = partial.get(c, rows[i - 1][c:c + 1])
            with tf.device(v.device):
                partial[c] = allreduce.send(left, v.device) + rows[i][c:c + 1]
    return [partial[c] for c in sorted(partial)]


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


def leaf_share(schedule: Schedule) -> float:
    """The share of a reducing schedule's additions that are leaves: both operands are
    towers' own chunks, none a partial an earlier addition made.

    Each chunk's additions form a tree over the ``n`` contributions; it has between one
    leaf (a chain: the ring, ``1/(n-1)``) and ``⌊n/2⌋`` (a balanced tree: halving-doubling
    and the other log-step schedules, ``2/3`` at 4 towers). A copy carries what it copies.

    Example:
        >>> leaf_share(ring_schedule(4)), leaf_share(ring_schedule(2))
        (0.3333333333333333, 1.0)
    """
    own = [[True] * schedule.chunks for _ in range(schedule.towers)]  # an input's chunk
    leaves = adds = 0
    for tick in schedule.ticks:
        before = [row[:] for row in own]  # a tick reads its slots as they were
        for s in tick:
            if s.kind == "copy":
                own[s.dst][s.chunk] = before[s.src][s.chunk]
                continue
            adds += 1
            leaves += before[s.src][s.chunk] and before[s.dst][s.chunk]
            own[s.dst][s.chunk] = False
    return leaves / adds if adds else 0.0


def in_sequence(share: float, n: int, parts_us: dict[str, float]) -> float:
    """A chunked schedule's parts one after the other: its additions priced between the
    two calibrations by its :func:`leaf_share` (the chain has ``1/(n-1)``, the leaves
    ``1``), plus the assembly. The executor overlaps them, so a schedule runs below this.

    Example:
        >>> in_sequence(2 / 3, 4, {"leaf adds": 130.0, "chain adds": 100.0, "assembly": 35.0})
        150.0
    """
    leaf, chain = parts_us[LEAF_ADDS], parts_us[CHAIN_ADDS]
    low = 1 / (n - 1) if n > 1 else 1.0
    adds = leaf if low >= 1 else chain + (leaf - chain) * (share - low) / (1 - low)
    return adds + parts_us[ASSEMBLY]
