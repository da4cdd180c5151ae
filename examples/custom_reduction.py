"""Write your own all-reduce, check it with ``check_all_reduce``, then train with it.

What it teaches: an algorithm is just ``fn(values, *, op) -> list`` (one tensor
per tower in, one per tower out, output i on input i's device), composed here
from the library's ring phases. A *bidirectional ring* sends half of every buffer
clockwise and the other half anticlockwise, so both directions of every link
carry data each tick: the same 2(n − 1) ticks as the ring, each moving half as
much per direction. ``check_all_reduce`` draws tower counts, shapes, dtypes and
ops and checks values, placement, agreement and the ``bytes_sent`` formula its
registry record gives (``register(Algorithm(...))``, one line); once
it passes, ``TowerTrainer(all_reduce=bidirectional_ring)`` trains with it.

Draw it: python -m towers trace --algorithm examples/custom_reduction.py:bidirectional_ring

Run: python examples/custom_reduction.py [--steps 30] [--examples 16]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def bidirectional_ring(values: Sequence[Any], *, op: str = "sum") -> list[Any]:
    """Half of each buffer goes round the ring clockwise, the other half anticlockwise."""
    from towers.allreduce.machinery.base import check_values
    from towers.allreduce.machinery.primitives import all_gather, pad_split, reduce_scatter, unsplit

    devices = check_values(values, op)
    n = len(values)
    split = [pad_split(v, 2 * n) for v in values]  # 2n equal chunks, zero-padded
    _, shape, size = split[0]
    out: list[list[Any]] = [[None] * (2 * n) for _ in range(n)]
    clockwise, anticlockwise = list(range(n)), [0, *range(n - 1, 0, -1)]
    for half, order in enumerate((clockwise, anticlockwise)):
        ids = [half * n + k for k in range(n)]  # chunks 0..n-1 clockwise, n..2n-1 anti
        mine = [[pieces[i] for i in ids] for pieces, _, _ in split]
        owned = reduce_scatter(mine, devices, op, 0, order=order, chunk_ids=ids)
        gathered = all_gather(owned, devices, n - 1, order=order, chunk_ids=ids)
        for tower in range(n):
            for g, i in enumerate(ids):
                out[tower][i] = gathered[tower][g]
    return [unsplit(out[tower], shape, size) for tower in range(n)]


def _bytes_sent(n: int, nbytes: int, itemsize: int) -> list[int]:
    """Each direction: 2(n - 1) chunks of ceil(size / 2n) elements per tower."""
    chunk = -(-(nbytes // itemsize) // (2 * n))
    return [2 * 2 * (n - 1) * chunk * itemsize] * n


def _summation_depth(n: int) -> int:
    """Each chunk goes once round its ring: n - 1 additions."""
    return max(n - 1, 0)


def _register() -> Any:
    """One record tells tools what the algorithm is; ``ALGORITHMS["bidirectional_ring"]()``."""
    from towers.allreduce import Algorithm, register

    return register(Algorithm("bidirectional_ring", lambda: bidirectional_ring,
                              bytes_sent=_bytes_sent, summation_depth=_summation_depth))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--examples", type=int, default=16, help="Hypothesis examples (16)")
    args = parser.parse_args()
    import towers

    devices = towers.simulate_devices(args.towers)  # first thing: before TensorFlow starts
    import keras

    from towers.testing import check_all_reduce
    from towers.training.data import batches, digits
    from towers.training.models import digits_cnn

    report = check_all_reduce(_register()(), max_towers=args.towers,
                              max_examples=args.examples, devices=devices)
    print(report)
    assert report.ok, "fix the algorithm before training with it"

    x, y, _, _ = digits()
    trainer = towers.TowerTrainer(
        digits_cnn, keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=devices, all_reduce=bidirectional_ring, variables="replicated",
    )
    for step, (xb, yb) in zip(range(args.steps), batches(x, y, 64, seed=0)):
        loss = float(trainer.train_step(xb, yb))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss:.4f}")
    stats = trainer.last_step_stats
    assert stats is not None
    sent = [stats.bytes_per_tower.get(d, 0) for d in devices]
    print(f"one step sends per tower (gradients, weights, state): {sent} bytes, "
          f"{stats.ticks} ticks per all-reduce")


if __name__ == "__main__":
    main()
