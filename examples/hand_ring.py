"""A ring all-reduce written by hand, printing every tick, checked against NumPy.

What it teaches: the ring moves one chunk per tower per tick. In n − 1
reduce-scatter ticks each tower passes a running partial sum to its right-hand
neighbour, which adds its own copy; afterwards tower i owns chunk i + 1 fully
summed. In n − 1 all-gather ticks the finished chunks travel round once more,
copied. Every tower sends 2(n − 1) chunks of S/n bytes, 2(n − 1)/n·S in all,
whatever n is: that is why the ring is bandwidth-optimal. Data crosses devices
only through ``towers.allreduce.send``, so ``record()`` can count it.

(``towers.allreduce.ring`` is the library's version: it also pads sizes that n
does not divide, supports max/min/mean and several rings at once.)

Run: python examples/hand_ring.py [--towers 4] [--size 8]
"""

from __future__ import annotations

import argparse
from typing import Any

import towers


def hand_ring(values: list[Any], devices: list[str]) -> list[Any]:
    """Sum ``values`` (one 1-D tensor per tower, length a multiple of n) round the ring."""
    import tensorflow as tf

    from towers.allreduce import send

    n = len(values)
    chunks = []  # chunks[tower][k], each on its tower's device
    for v, d in zip(values, devices):
        with tf.device(d):
            chunks.append(tf.split(v, n))
    for t in range(n - 1):  # reduce-scatter: tower i sends chunk (i - t) mod n
        print(f"tick {t}  reduce-scatter")
        moved = []  # send everything first: a tick's sends use the partials from before it
        for i in range(n):
            k, dst = (i - t) % n, (i + 1) % n
            print(f"  tower {i} -> tower {dst}: partial sum of chunk {k}")
            moved.append((dst, k, send(chunks[i][k], devices[dst], tick=t, chunk=k)))
        for dst, k, partial in moved:
            with tf.device(devices[dst]):
                chunks[dst][k] = partial + chunks[dst][k]
    for t in range(n - 1):  # all-gather: tower i sends chunk (i + 1 - t) mod n, finished
        print(f"tick {n - 1 + t}  all-gather")
        moved = []
        for i in range(n):
            k, dst = (i + 1 - t) % n, (i + 1) % n
            print(f"  tower {i} -> tower {dst}: finished chunk {k}")
            moved.append((dst, k, send(chunks[i][k], devices[dst], tick=n - 1 + t, chunk=k)))
        for dst, k, finished in moved:
            chunks[dst][k] = finished  # a copy: every tower ends with the same bits
    outs = []
    for i, d in enumerate(devices):
        with tf.device(d):
            outs.append(tf.concat(chunks[i], 0))
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--size", type=int, default=8, help="elements per tower (a multiple of n)")
    args = parser.parse_args()
    n, size = args.towers, args.size
    if size % n:
        parser.error("--size must be a multiple of --towers (towers' ring pads; this one does not)")
    devices = towers.simulate_devices(n)  # first thing: before TensorFlow starts

    import numpy as np
    import tensorflow as tf

    from towers.allreduce import record

    arrays = [np.random.default_rng(i).normal(size=size).astype(np.float32) for i in range(n)]
    values = []
    for array, d in zip(arrays, devices):
        with tf.device(d):
            values.append(tf.constant(array))
    with record() as recorder:
        outs = hand_ring(values, devices)
    exact = np.sum(np.stack(arrays).astype(np.float64), axis=0)
    error = max(float(np.max(np.abs(out.numpy() - exact))) for out in outs)
    same = all(np.array_equal(out.numpy(), outs[0].numpy()) for out in outs)
    sent, formula = recorder.bytes_sent(), 2 * (n - 1) * size * 4 // n
    print(f"bytes sent per tower: {[sent[d] for d in devices]} (2(n-1)/n·S = {formula})")
    print(f"max abs error vs NumPy's float64 sum: {error:.3g}; towers bitwise identical: {same}")
    assert error < 1e-5 * max(1.0, float(np.max(np.abs(exact)))) and same
    print("OK: the hand-written ring matches NumPy")


if __name__ == "__main__":
    main()
