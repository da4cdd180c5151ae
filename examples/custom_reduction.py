"""Write your own all-reduce, check it with ``check_all_reduce``, then train with it.

What it teaches: an algorithm is just ``fn(values, *, op) -> list`` (one tensor
per tower in, one per tower out, output i on input i's device), written here as
a schedule — data: per tick, which tower sends which chunk where, to copy or to
reduce — that the library's one interpreter (``run_schedule``) runs. A
*bidirectional ring* sends half of every buffer clockwise and the other half
anticlockwise, so both directions of every link carry data each tick: the same
2(n − 1) ticks as the ring, each moving half as much per direction.
``check_all_reduce`` draws tower counts, shapes, dtypes and ops and checks values,
placement, agreement and the ``bytes_sent`` its registry record counts from the
schedule (``register(Algorithm(...))``, one line); once it passes,
``TowerTrainer(all_reduce=bidirectional_ring)`` trains with it.

Draw it: python -m towers trace --algorithm examples/custom_reduction.py:bidirectional_ring

Run: python examples/custom_reduction.py [--steps 30] [--examples 16]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def bidirectional_ring_schedule(n: int) -> Any:
    """Chunks 0..n-1 go round the ring clockwise (``towers.schedule.ring_schedule``),
    chunks n..2n-1 round its mirror image (tower p plays tower -p mod n): anticlockwise."""
    from towers.schedule import Schedule, Step, ring_schedule

    ring = ring_schedule(n)
    ticks = [tick + tuple(Step(-s.src % n, -s.dst % n, n + s.chunk, s.kind) for s in tick)
             for tick in ring.ticks]
    return Schedule("bidirectional_ring", n, 2 * n, tuple(ticks))


def bidirectional_ring(values: Sequence[Any], *, op: str = "sum") -> list[Any]:
    """Half of each buffer goes round the ring clockwise, the other half anticlockwise."""
    from towers.allreduce import run_schedule

    return run_schedule(bidirectional_ring_schedule(len(values)), values, op=op)


def _register() -> Any:
    """One record tells tools what the algorithm is; ``ALGORITHMS["bidirectional_ring"]()``.
    Its bytes and summation depth are counted from the schedule."""
    from towers.allreduce import Algorithm, register
    from towers.allreduce.machinery.registry import from_schedule

    return register(Algorithm("bidirectional_ring", lambda: bidirectional_ring,
                              **from_schedule(bidirectional_ring_schedule)))


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
