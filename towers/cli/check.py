"""Check an all-reduce against the contract, on simulated towers, with Hypothesis.

For every tower count Hypothesis draws shapes, dtypes and ops; every output must be within
the summation-depth bound of the exact reduction, on its device, bitwise equal across towers,
its bytes the record's ``bytes_sent`` (with --replay: bitwise the NumPy replay). The verdict
names the smallest failing example. A schedule (``swing``) is first proved for 1..--prove.

Exit status: 0 when every property was verified, 1 on a failure, 2 for bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from towers.cli.arguments import DTYPES, OPS, algorithm, at_least, choices, tower_counts

__all__ = ["EPILOG", "add_arguments", "budgets", "run", "usage_problem"]

EPILOG = """examples:
  python -m towers check my_algos:star                     # ./my_algos.py
  python -m towers check my_algos:star --max-towers 4 --examples 40
  python -m towers check my_algos.py:make_star --dtypes float32,float64 --ops sum,mean
  python -m towers check hierarchical --towers 2,4,8 --replay
  python -m towers check ring --seed -1                   # fresh examples every run
  python -m towers check swing --prove 256                # a schedule: proved for n=1..256 too
"""


def budgets(examples: int, count: int) -> list[int]:
    """``examples`` spread over ``count`` tower counts, at least 2 each."""
    return [max(2, examples // count + (k < examples % count)) for k in range(count)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("algorithm", type=algorithm, help="a registered name, module:function or "
        "file.py:function")
    add("--max-towers", type=at_least(1), default=8,
        help="largest tower count; simulates this many devices")
    add("--towers", type=tower_counts, default=None, metavar="N,N,...",
        help="only these tower counts (default 1..max-towers), e.g. 2,4,8")
    add("--examples", type=at_least(1), default=20,
        help="drawn examples in all, spread over the tower counts, at least 2 each; each "
        "count also runs its stratified examples")
    add("--ops", type=choices(OPS, "op"), default=None, metavar="OP,...",
        help=f"ops to draw (default {','.join(OPS)})")
    add("--dtypes", type=choices(DTYPES, "dtype"), default=None, metavar="DTYPE,...",
        help=f"dtypes to draw (default {','.join(DTYPES)})")
    add("--seed", type=int, default=0, help="Hypothesis seed (default 0; -1: a fresh draw)")
    add("--prove", type=at_least(0), default=64, metavar="N",
        help="schedule-defined algorithms: prove the schedule symbolically for every tower "
        "count 1..N first (0 skips)")
    add("--replay", action="store_true",
        help="also demand bitwise equality with the NumPy replay (slower)")


def usage_problem(args: argparse.Namespace) -> str | None:
    if args.towers and max(args.towers) > args.max_towers:
        return (f"argument --towers: {max(args.towers)} is more than --max-towers "
                f"{args.max_towers}; raise --max-towers or drop that count")
    return None


def _check(args: argparse.Namespace, name: str, fn: Any, counts: list[int],
           devices: list[str]) -> Any:
    import keras

    from towers.allreduce.machinery.base import DTYPES, OPS
    from towers.testing import check_all_reduce

    bar = keras.utils.Progbar(len(counts), unit_name="tower count")
    total, strata, report = 0, 0, None
    for k, (n, budget) in enumerate(zip(counts, budgets(args.examples, len(counts)))):
        report = check_all_reduce(
            fn, tower_counts=[n], max_examples=budget, max_towers=args.max_towers,
            devices=devices, seed=None if args.seed == -1 else args.seed, replay=args.replay,
            ops=args.ops or OPS, dtypes=args.dtypes or DTYPES)
        total, strata = total + report.examples, strata + report.stratified
        bar.update(k + 1, finalize=not report.ok or k + 1 == len(counts))
        if not report.ok:
            break
    assert report is not None  # counts is not empty
    return dataclasses.replace(report, algorithm=name, examples=total, stratified=strata)


def run(args: argparse.Namespace) -> int:
    from towers.trace.schedule import start_devices

    devices = start_devices(args.max_towers)  # first: before TensorFlow's runtime starts
    from towers.allreduce.machinery.resolve import get, label
    from towers.allreduce.machinery.scheduled import generator_of
    from towers.schedule import check_schedule

    counts = sorted(args.towers or range(1, args.max_towers + 1))
    name, fn = label(args.algorithm), get(args.algorithm, argument="algorithm", devices=devices)
    generator = generator_of(fn)
    if generator is not None and args.prove > 0:  # a schedule: proved symbolically first
        proof = check_schedule(generator, range(1, args.prove + 1))
        print(proof)
        if not proof.ok:
            return 1
    print(f"towers check: {name} over tower counts {counts}: "
          f"{sum(budgets(args.examples, len(counts)))} drawn examples, then each count's "
          "stratified ones")
    report = _check(args, name, fn, counts, devices)
    print(report)
    return 0 if report.ok else 1
