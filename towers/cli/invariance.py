"""Does training give the same result on 1, 2, 4, 8 towers? Check it on the bundled digits.

Runs ``towers.testing.check_invariance``: one trainer per tower count, the same
batches from the same initial weights. Each step is compared from the same
weights (teacher forcing): every tower count's reduced gradient against the first
count's, element by element, within the bound of both runs' summation depths
(``towers.testing.onestep``). The free-running weight difference is printed beside
it, as information. The table names the first (towers, step, variable) outside.

Exit status: 0 when every step lies within its bound, 1 when one does not, 2 for
bad options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from towers.cli.train import at_least, positive_float

__all__ = ["EPILOG", "MODELS", "add_arguments", "digits_problem", "run", "tower_counts"]

EPILOG = """examples:
  python -m towers invariance --towers 1,2,4,8 --algorithm ring --steps 5
  python -m towers invariance --towers 1,3 --algorithm my_algos.py:star --model conv
"""

MODELS = ("mlp", "conv")
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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options shared with ``towers bisect``: model, batch, steps, learning rate."""
    parser.add_argument("--model", choices=MODELS, default="mlp",
                        help="mlp (64-32-10, tanh) or conv (the digits CNN); default mlp")
    parser.add_argument("--steps", type=at_least(1), default=5, help="steps (default 5)")
    parser.add_argument("--batch", type=at_least(1), default=32,
                        help="global batch size (default 32)")
    parser.add_argument("--lr", type=positive_float, default=0.1,
                        help="plain SGD learning rate (default 0.1)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``towers invariance``."""
    parser.add_argument("--towers", type=tower_counts, default=[1, 2, 4, 8], metavar="N,N,...",
                        help="tower counts; the first is the reference (default 1,2,4,8)")
    parser.add_argument("--algorithm", default="ring",
                        help="a registered name, module:function or file.py:function "
                        "(default ring)")
    parser.add_argument("--variables", choices=("replicated", "parameter_device"),
                        default="replicated", help="placement (default replicated)")
    add_model_arguments(parser)


def digits_problem(model: str, batch: int, steps: int, lr: float) -> tuple[Any, ...]:
    """``(model_fn, optimizer_fn, loss, batches)`` on the bundled digits.

    Raises:
        ValueError: ``batch·steps`` exceeds the training set.
    """
    import keras

    from towers.training.data import batches, digits
    from towers.training.models import digits_cnn, mlp

    x, y, _, _ = digits()
    if batch * steps > len(x):
        raise ValueError(f"--batch × --steps must be at most {len(x)} (the digits training "
                         f"set), got {batch} × {steps}")  # fmt: skip
    if model == "mlp":
        x = x.reshape(len(x), -1)
    data = [(bx, by) for bx, by in batches(x, y, batch, seed=0)][:steps]
    model_fn: Callable[[], Any] = (lambda: mlp((64, 32, 10))) if model == "mlp" else digits_cnn
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model_fn, lambda: keras.optimizers.SGD(lr), loss, data


def _fail(message: str) -> int:
    print(f"towers invariance: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the check; returns a process exit code."""
    from towers.trace.loading import load_algorithm, start_devices

    try:
        devices = start_devices(max(args.towers))  # first: before TensorFlow's runtime starts
        problem = digits_problem(args.model, args.batch, args.steps, args.lr)
        name, algorithm = load_algorithm(args.algorithm, devices)
    except (ValueError, TypeError, RuntimeError) as err:
        return _fail(str(err))
    from towers.testing import check_invariance

    print(f"towers invariance: {name}, {args.model}, towers {args.towers}, "
          f"batch {args.batch}, {args.steps} steps")  # fmt: skip
    try:
        report = check_invariance(*problem, towers=args.towers, all_reduce=algorithm,
                                  variables=args.variables, steps=args.steps)  # fmt: skip
    except (ValueError, TypeError) as err:
        return _fail(str(err))
    print(report)
    return 0 if report.ok else 1
