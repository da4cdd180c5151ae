"""Check an all-reduce against the contract, on simulated towers, with Hypothesis.

Runs ``towers.testing.check_all_reduce`` for every tower count from 1 to
--max-towers (or the counts given with --towers), drawing shapes (``()``, ``(0,)``,
primes, sizes no tower count divides), dtypes and ops, and checks every output:
its value within the summation-depth bound of the exact reduction, its device,
bitwise agreement between towers, the bytes counted at ``send`` against the
algorithm's registry record's ``bytes_sent`` (when it has one) and, with --replay,
bitwise equality with the NumPy replay of its graph. An algorithm that cannot be
replayed (opaque collectives such as nccl, or ops the replay has no kernel for)
fails --replay with the reason; it never passes silently. The verdict names the
smallest failing example Hypothesis could shrink to.

An algorithm defined by a schedule (``swing``, or ``towers.allreduce.machinery.scheduled(gen)``)
is first proved symbolically for every tower count 1..--prove (default 64, no
TensorFlow, see ``towers.schedule.check_schedule``): a wrong schedule is rejected
with the smallest failing tower count, the first tick that breaks and the state
there, drawn, before anything runs on devices.

The algorithm is a registered name or module:function (file.py:function); a
factory (anything not taking ``(values, *, op)``) is called with no arguments.

Exit status: 0 only when every claimed property was verified, 1 on a failure (a
replay that cannot replay included), 2 for bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from towers.cli.arguments import algorithm, choices, dtypes, ops
from towers.cli.train import at_least

__all__ = ["EPILOG", "add_arguments", "budgets", "run", "usage_problem"]

EPILOG = """examples:
  python -m towers check my_algos:star                     # ./my_algos.py
  python -m towers check my_algos:star --max-towers 4 --examples 40
  python -m towers check my_algos.py:make_star --dtypes float32,float64 --ops sum,mean
  python -m towers check hierarchical --towers 2,4,8 --replay
  python -m towers check ring --seed -1                   # fresh examples every run
  python -m towers check swing --prove 256                # a schedule: proved for n=1..256 too
"""


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _counts(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in _names(text)})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"expected tower counts >= 1 like 2,4,8; got {text!r}")
    return counts


def budgets(examples: int, count: int) -> list[int]:
    """``examples`` spread over ``count`` tower counts as evenly as they go, at least 2 each:
    what each count's search draws, so the total announced is the total run."""
    return [max(2, examples // count + (k < examples % count)) for k in range(count)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``towers check``."""
    parser.add_argument("algorithm", type=algorithm,
                        help="a registered name, module:function or file.py:function")
    parser.add_argument("--max-towers", type=at_least(1), default=8,
                        help="largest tower count; simulates this many devices (default 8)")
    parser.add_argument("--towers", type=_counts, default=None, metavar="N,N,...",
                        help="only these tower counts (default 1..max-towers), e.g. 2,4,8")
    parser.add_argument("--examples", type=at_least(1), default=20,
                        help="drawn examples in all, spread over the tower counts, at least 2 "
                        "each (default 20); each count also runs its stratified examples")
    parser.add_argument("--ops", type=choices(ops, "op"), default=None, metavar="OP,...",
                        help="ops to draw (default sum,mean,max,min)")
    parser.add_argument("--dtypes", type=choices(dtypes, "dtype"), default=None,
                        metavar="DTYPE,...",
                        help="dtypes to draw (default: float16,bfloat16,float32,float64,int32,"
                        "int64)")
    parser.add_argument("--seed", type=int, default=0,
                        help="Hypothesis seed for reproducible runs (default 0; -1: a fresh draw)")
    parser.add_argument("--prove", type=at_least(0), default=64, metavar="N",
                        help="schedule-defined algorithms: prove the schedule symbolically "
                        "for every tower count 1..N first (default 64; 0 skips)")
    parser.add_argument("--replay", action="store_true",
                        help="also demand bitwise equality with the NumPy replay (slower)")


def _options(args: argparse.Namespace, devices: list[str]) -> dict[str, Any]:
    from towers.allreduce.machinery.base import DTYPES, OPS

    return {
        "max_towers": args.max_towers,
        "devices": devices,
        "seed": None if args.seed == -1 else args.seed,
        "replay": args.replay,
        "ops": args.ops or OPS,
        "dtypes": args.dtypes or DTYPES,
    }


def _check(name: str, fn: Any, counts: list[int], examples: int, options: dict[str, Any]) -> Any:
    """One search per tower count, ascending, with a progress bar; stops at the first failure."""
    import keras

    from towers.testing import check_all_reduce

    bar = keras.utils.Progbar(len(counts), unit_name="tower count")
    total, strata, report = 0, 0, None
    for k, (n, budget) in enumerate(zip(counts, budgets(examples, len(counts)))):
        report = check_all_reduce(fn, tower_counts=[n], max_examples=budget, **options)
        total, strata = total + report.examples, strata + report.stratified
        bar.update(k + 1, finalize=not report.ok or k + 1 == len(counts))
        if not report.ok:
            break
    assert report is not None  # counts is not empty
    return dataclasses.replace(report, algorithm=name, examples=total, stratified=strata)


def _prove(fn: Any, upto: int) -> bool:
    """Print the symbolic verdict for a schedule-defined algorithm; False when rejected."""
    from towers.allreduce.machinery.scheduled import generator_of
    from towers.schedule import check_schedule

    generator = generator_of(fn)
    if generator is None or upto < 1:
        return True
    report = check_schedule(generator, range(1, upto + 1))
    print(report)
    return report.ok


def usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options (None: nothing), before TensorFlow is imported."""
    if args.towers and args.towers[-1] > args.max_towers:
        return (f"argument --towers: {args.towers[-1]} is more than --max-towers "
                f"{args.max_towers}; raise --max-towers or drop that count")
    return None


def run(args: argparse.Namespace) -> int:
    """Run the job; returns a process exit code."""
    counts = args.towers or list(range(1, args.max_towers + 1))
    from towers.allreduce.machinery.resolve import get, label
    from towers.trace.schedule import start_devices

    devices = start_devices(args.max_towers)  # first thing: before TensorFlow's runtime starts
    try:
        name, fn = label(args.algorithm), get(args.algorithm, argument="algorithm",
                                              devices=devices)
        options = _options(args, devices)
        if not _prove(fn, args.prove):
            return 1
        drawn = sum(budgets(args.examples, len(counts)))
        print(f"towers check: {name} over tower counts {counts}: {drawn} drawn examples, "
              "then each count's stratified ones")
        report = _check(name, fn, counts, args.examples, options)
    except (ValueError, TypeError) as err:
        print(f"towers check: error: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1
