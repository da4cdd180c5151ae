"""Does training give the same result on 1, 2, 4, 8 towers? Check it on digits or your data.

Runs ``towers.testing.check_invariance``: one trainer per tower count, the same
batches from the same initial weights. Each step is compared from the same
weights (teacher forcing): every tower count's reduced gradient against the first
count's, element by element, within the bound of both runs' summation depths
(``towers.testing.steps``). The free-running weight difference is printed beside
it, as information. The table names the first (towers, step, variable) outside.

--model, --data, --optimizer and --loss take your model (``module:fn``), data
(``file.npz`` with ``x`` and ``y``) and optimizer, as in ``towers compare``.

Exit status: 0 when every step lies within its bound, 1 when one does not because of
the all-reduce, 3 when only kernel noise does (every all-reduce within its own bound;
the towers' kernels computed an example differently at another shard size), 2 for
bad options.
"""

from __future__ import annotations

import argparse
import sys

from towers.cli.arguments import algorithm, user_object
from towers.cli.compare import add_problem_arguments, exit_code, load_problem
from towers.cli.train import positive_float

__all__ = ["EPILOG", "add_arguments", "run", "tower_counts"]

EPILOG = """examples:
  python -m towers invariance --towers 1,2,4,8 --algorithm ring --steps 5
  python -m towers invariance --towers 1,3 --algorithm my_algos.py:star --model conv
  python -m towers invariance --towers 1,4 --step reference:MirroredTrainer --batch 10
"""

MAX_TOWERS = 64


def tower_counts(text: str) -> list[int]:
    """An argparse ``type``: distinct tower counts like ``1,2,4,8``, each in 1..64."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"expected tower counts like 1,2,4,8; got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not counts or len(set(counts)) != len(counts) or not all(
        1 <= n <= MAX_TOWERS for n in counts
    ):
        raise argparse.ArgumentTypeError(
            f"expected distinct tower counts in 1..{MAX_TOWERS} like 1,2,4,8; got {text!r}"
        )
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``towers invariance``."""
    parser.add_argument("--towers", type=tower_counts, default=[1, 2, 4, 8], metavar="N,N,...",
                        help="tower counts; the first is the reference (default 1,2,4,8)")
    parser.add_argument("--algorithm", type=algorithm, default="ring",
                        help="a registered name, module:function or file.py:function "
                        "(default ring)")
    parser.add_argument("--variables", choices=("replicated", "parameter_device"),
                        default="replicated", help="placement (default replicated)")
    parser.add_argument("--step", type=user_object("step factory"), default=None,
                        metavar="MODULE:FACTORY",
                        help="check your step instead: factory(model_fn, optimizer_fn, loss, "
                        "devices) is called once per tower count")  # fmt: skip
    parser.add_argument("--bound", type=positive_float, default=None, metavar="TOL",
                        help="--step's tolerance per element (optimizers other than plain SGD)")
    add_problem_arguments(parser)


def _fail(message: str) -> int:
    print(f"towers invariance: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the check; returns a process exit code."""
    from towers.allreduce.machinery.resolve import get, imported, label
    from towers.trace.loading import start_devices

    try:
        devices = start_devices(max(args.towers))  # first: before TensorFlow's runtime starts
        problem = load_problem(args)
        name = label(args.algorithm)
        algorithm = get(args.algorithm, argument="algorithm", devices=devices)
        factory = None if args.step is None else imported(args.step, "--step")
        if factory is not None and not callable(factory):
            raise TypeError(f"--step {args.step} is a {type(factory).__name__}, not a callable")
        name = name if factory is None else args.step
    except (ValueError, TypeError, RuntimeError) as err:
        return _fail(str(err))
    from towers.testing import check_invariance

    print(f"towers invariance: {name}, {args.model}, towers {args.towers}, "
          f"batch {args.batch}, {args.steps} steps")  # fmt: skip
    try:
        report = check_invariance(*problem, towers=args.towers, all_reduce=algorithm,
                                  variables=args.variables, steps=args.steps, step=factory,
                                  bound=args.bound)  # fmt: skip
    except (ValueError, TypeError) as err:
        return _fail(str(err))
    print(report)
    return exit_code(report)
