"""Graph size of the chunked all-reduces: ops of the traced graph against the schedule.

::

    algorithm   n   ops   messages (tick, src, dst)   chunk steps   ops/message

The interpreter (:mod:`towers.allreduce.machinery.scheduled`) packs a tick's chunks
between two towers into one message, so the op count follows the messages; chunk by
chunk it followed the steps (2n(n − 1) for every bandwidth-optimal schedule here).
Only traced, never run: device names need not exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce import ALGORITHMS, all_reduce

__all__ = ["CHUNKED", "op_count", "opcount_rows", "opcount_section"]

CHUNKED = ("ring", "swing", "bruck", "pat", "torus_2d", "halving_doubling")


def op_count(name: str, n: int, size: int = 1000) -> int:
    """Ops in the traced all-reduce (``name``) of one ``size``-element value per tower."""
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]

    def run(*xs: tf.Tensor) -> list[tf.Tensor]:
        values = []
        for x, device in zip(xs, devices):
            with tf.device(device):
                values.append(tf.identity(x))
        return all_reduce(values, algorithm=name)

    specs = [tf.TensorSpec([size], tf.float32)] * n
    return len(tf.function(run).get_concrete_function(*specs).graph.get_operations())


def opcount_rows(names: Sequence[str] = CHUNKED,
                 counts: Sequence[int] = (4, 8, 16)) -> list[dict[str, Any]]:
    """One row per (algorithm, n): ops, messages and chunk steps of its schedule."""
    rows = []
    for name in names:
        generator = ALGORITHMS[name].generator
        assert generator is not None  # every CHUNKED algorithm is a schedule
        for n in counts:
            ticks = generator(n).ticks
            messages = sum(len({(s.src, s.dst) for s in tick}) for tick in ticks)
            ops = op_count(name, n)
            rows.append({"algorithm": name, "n": n, "ops": ops, "messages": messages,
                         "steps": sum(len(t) for t in ticks), "ops_per_message": ops / messages})
    return rows


def opcount_section(args: Any, devices: list[str], results: dict) -> bool:
    """``towers bench --sections opcount``: the table."""
    rows = opcount_rows()
    print("\n== graph ops of the chunked all-reduces (1000 floats per tower, traced)")
    print(f"{'algorithm':<18} {'n':>3} {'ops':>6} {'messages':>9} {'steps':>6} {'ops/msg':>8}")
    for r in rows:
        print(f"{r['algorithm']:<18} {r['n']:>3} {r['ops']:>6} {r['messages']:>9} "
              f"{r['steps']:>6} {r['ops_per_message']:>8.1f}")
    results["opcount"] = rows
    return True
