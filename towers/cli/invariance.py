"""Does training give the same result on 1, 2, 4, 8 towers? Check it on digits or your data.

One trainer per tower count, the same batches from the same weights at every step; each
count's reduced gradient must match the first count's within both runs' summation bounds.

Exit status: 0 within every bound, 1 outside because of the all-reduce, 3 only kernel
noise (every all-reduce within its own bound), 2 for bad options.
"""

from __future__ import annotations

import argparse

from towers.cli.arguments import VARIABLES, algorithm, positive_float, step, tower_counts
from towers.cli.compare import add_problem_arguments, exit_code, factory, load_problem

__all__ = ["EPILOG", "add_arguments", "run"]

EPILOG = """examples:
  python -m towers invariance --towers 1,2,4,8 --algorithm ring --steps 5
  python -m towers invariance --towers 1,3 --algorithm my_algos.py:star --model conv
  python -m towers invariance --towers 1,4 --step reference:MirroredTrainer --batch 10
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--towers", type=tower_counts, default=[1, 2, 4, 8], metavar="N,N,...",
        help="tower counts; the first is the reference")
    add("--algorithm", type=algorithm, default="ring",
        help="a registered name, module:function or file.py:function")
    add("--variables", choices=VARIABLES, default="replicated", help="placement")
    add("--step", type=step, default=None, metavar="MODULE:FACTORY",
        help="check your step instead: factory(model_fn, optimizer_fn, loss, devices) is "
        "called once per tower count")
    add("--bound", type=positive_float, default=None, metavar="TOL",
        help="--step's tolerance per element (optimizers other than plain SGD)")
    add_problem_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from towers.trace.schedule import start_devices

    devices = start_devices(max(args.towers))  # first: before TensorFlow's runtime starts
    problem = load_problem(args)
    from towers.allreduce.machinery.resolve import get, label
    from towers.testing import check_invariance

    all_reduce = get(args.algorithm, argument="algorithm", devices=devices)
    step = None if args.step is None else factory(args.step, "--step")
    print(f"towers invariance: {label(args.algorithm) if step is None else args.step}, "
          f"{args.model}, towers {args.towers}, batch {args.batch}, {args.steps} steps")
    report = check_invariance(*problem, towers=args.towers, all_reduce=all_reduce,
                              variables=args.variables, steps=args.steps, step=step,
                              bound=args.bound)
    print(report)
    return exit_code(report)
