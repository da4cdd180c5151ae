"""Find where two steps part: the first step, variable and element outside the bound.

Runs ``towers.testing.bisect`` (on the bundled digits, or your model and data): step
A (the teacher) and B train on the same batches from the same weights; before every
step B is set to A's weights, so each step is judged on its own, and it stops at the
first step outside. Two towers trainers are compared on their reduced gradients (the
step's phases); anything else (a ``tf.distribute`` reference, your step) on one
update, within the bound the report names (plain SGD's derived one, or ``--bound``).
The report names the first step outside the bound, its first variable in model
order, and the first element there: its chunk under B's split, both values, the
difference and the bound.

--a and --b take ``module:factory`` (your step: see ``towers compare``), a
registered name, ``towers:NAME``, ``module:function`` or ``file.py:function`` (a
user's reduction, or a factory of one), ``mirrored`` or ``central_storage``.

Exit status: 0 when no step left the bound, 1 when one did (the reduction or the
step differs), 3 when only kernel noise did (see ``towers compare``), 2 for bad options.
"""

from __future__ import annotations

import argparse

from towers.cli.compare import (
    add_problem_arguments,
    exit_code,
    fail,
    load_problem,
    load_side,
    side,
)
from towers.cli.train import at_least, positive_float

__all__ = ["EPILOG", "add_arguments", "run"]

EPILOG = """examples:
  python -m towers bisect --a ring --b towers:naive --towers 4 --steps 5
  python -m towers bisect --a ring --b mirrored --model conv
  python -m towers bisect --a naive --b my_algos.py:star --towers 3
  python -m towers bisect --a towers.step:TowerTrainer --b my_loop:make_step --data d.npz
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``towers bisect``."""
    parser.add_argument("--a", required=True, metavar="CONFIG", type=side,
                        help="the teacher: an algorithm, towers:NAME, module:function, "
                        "mirrored or central_storage")
    parser.add_argument("--b", required=True, metavar="CONFIG", type=side,
                        help="the one under test")
    parser.add_argument("--towers", type=at_least(1), default=4,
                        help="towers of both runs (default 4)")
    parser.add_argument("--variables", choices=("replicated", "parameter_device"),
                        default="replicated", help="placement of towers runs (default replicated)")
    parser.add_argument("--bound", type=positive_float, default=None, metavar="TOL",
                        help="a tolerance per element (optimizers without a derived bound)")
    add_problem_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the bisection; returns a process exit code."""
    from towers.trace.loading import start_devices

    try:
        devices = start_devices(args.towers)  # first: before TensorFlow's runtime starts
        problem = load_problem(args)
        sides = [load_side(spec, problem, devices, args.variables) for spec in (args.a, args.b)]
        from towers.testing import bisect

        print(f"towers bisect: {args.a} vs {args.b}, {args.model}, {args.towers} towers, "
              f"batch {args.batch}, up to {args.steps} steps")  # fmt: skip
        report = bisect(sides[0], sides[1], problem[3], model_fn=problem[0],
                        optimizer_fn=problem[1], loss=problem[2], towers=args.towers,
                        steps=args.steps, bound=args.bound)  # fmt: skip
    except (ValueError, TypeError, RuntimeError) as err:
        return fail("bisect", err)
    print(report)
    return exit_code(report)
