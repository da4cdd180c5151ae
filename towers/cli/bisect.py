"""Find where two configurations part: the first step, variable and element outside the bound.

Runs ``towers.testing.bisect`` on the bundled digits: configuration A (the teacher)
and B train on the same batches from the same weights; before every step B is set
to A's weights, so each step is judged on its own. Two towers algorithms are
compared on their reduced gradients (the step's phases); a ``tf.distribute``
reference (``mirrored``, ``central_storage``) on one plain-SGD update. The report
names the first step outside the bound, its first variable in model order, and the
first element there: its chunk under B's split, both values, the difference and
the bound.

--a and --b take a registered name, ``towers:NAME``, ``module:function`` or
``file.py:function`` (a user's reduction, or a factory of one), ``mirrored`` or
``central_storage``.

Exit status: 0 when no step left the bound, 1 when one did, 2 for bad options.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from towers.cli.invariance import add_model_arguments, digits_problem
from towers.cli.train import at_least

__all__ = ["EPILOG", "add_arguments", "run"]

EPILOG = """examples:
  python -m towers bisect --a ring --b towers:naive --towers 4 --steps 5
  python -m towers bisect --a ring --b mirrored --model conv
  python -m towers bisect --a naive --b my_algos.py:star --towers 3
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``towers bisect``."""
    parser.add_argument("--a", required=True, metavar="CONFIG",
                        help="the teacher: an algorithm, towers:NAME, module:function, "
                        "mirrored or central_storage")
    parser.add_argument("--b", required=True, metavar="CONFIG", help="the one under test")
    parser.add_argument("--towers", type=at_least(1), default=4,
                        help="towers of both runs (default 4)")
    parser.add_argument("--variables", choices=("replicated", "parameter_device"),
                        default="replicated", help="placement of towers runs (default replicated)")
    add_model_arguments(parser)


def _side(spec: str, devices: list[str], variables: str) -> Any:
    """A ``Config`` from a command-line spec (names are loaded as ``towers check`` does)."""
    from towers.testing.compare import Config, config
    from towers.trace.loading import load_algorithm

    side = config(spec)  # checks "towers:NAME"
    if side.reference:
        return side
    name, algorithm = load_algorithm(side.all_reduce, devices)
    return Config(algorithm, variables, label=name)


def run(args: argparse.Namespace) -> int:
    """Run the bisection; returns a process exit code."""
    from towers.trace.loading import start_devices

    try:
        devices = start_devices(args.towers)  # first: before TensorFlow's runtime starts
        model_fn, optimizer_fn, loss, data = digits_problem(
            args.model, args.batch, args.steps, args.lr
        )
        sides = [_side(spec, devices, args.variables) for spec in (args.a, args.b)]
        from towers.testing import bisect

        print(f"towers bisect: {sides[0].name} vs {sides[1].name}, {args.model}, "
              f"{args.towers} towers, batch {args.batch}, up to {args.steps} steps")  # fmt: skip
        report = bisect(sides[0], sides[1], data, model_fn=model_fn, optimizer_fn=optimizer_fn,
                        loss=loss, towers=args.towers, steps=args.steps)  # fmt: skip
    except (ValueError, TypeError, RuntimeError) as err:
        print(f"towers bisect: error: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1
