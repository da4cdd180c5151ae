"""Two training steps side by side (``compare``), or where they part (``bisect``).

Step A (the teacher) and step B train on the same batches, B set to A's weights before
every step (``bisect`` stops at the first step outside the bound, ``--bound`` or plain SGD's).
The report names the first step, variable and element outside, both values and the bound.

--a and --b take:
  module:factory   your step: ``factory(model_fn, optimizer_fn, loss, devices)`` returning
                   an object with train_step(x, y), get_weights() and set_weights(ws)
  NAME, towers:NAME, mirrored, central_storage, module:function
                   a towers trainer with that all-reduce, or a tf.distribute reference

Exit status (``towers invariance`` too):
  0  every step within its bound
  1  a step differs: the reduction, or the step itself (a weighting, a missing term)
  2  bad options (one line on stderr, before any work)
  3  only kernel noise: outside the bound, but each run's all-reduce within its own
     bound; the towers' own kernels computed the same examples differently
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from towers.cli.arguments import VARIABLES, at_least, compared_step, model, positive_float

__all__ = ["EPILOG", "KERNEL_NOISE", "add_arguments", "add_problem_arguments", "digits_problem",
           "exit_code", "factory", "load_problem", "run"]

KERNEL_NOISE = 3  # exit status: outside the bound only by the towers' own kernels

EPILOG = """examples:
  python -m towers compare --a towers.step:TowerTrainer --b my_loop:make_step --optimizer adam \\
      --bound 1e-7
  python -m towers compare --a ring --b reference:MirroredTrainer --model my_models:small \\
      --data train.npz --batch 32
  python -m towers bisect --a ring --b towers:naive --towers 4 --steps 5
  python -m towers bisect --a ring --b mirrored --model conv
  python -m towers bisect --a naive --b my_algos.py:star --towers 3
"""


def _npz_file(text: str) -> str:
    if not text.endswith(".npz") or not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"expected an existing .npz file (arrays x, y), got "
                                         f"{text!r}")
    return text


def add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    """The options shared by compare, bisect and invariance: model, data, optimizer, loss."""
    add = parser.add_argument
    add("--model", type=model, default="mlp",
        metavar="MODEL", help="mlp (64-32-10, tanh), conv (the digits CNN) or module:fn")
    add("--data", type=_npz_file, default=None, metavar="FILE.npz",
        help="arrays x and y to train on (default: the bundled digits)")
    add("--optimizer", default="sgd", metavar="NAME",
        help="a Keras optimizer name: sgd, adam, rmsprop, …")
    add("--loss", default=None, metavar="NAME",
        help="a Keras loss name (default: cross-entropy on logits)")
    add("--steps", type=at_least(1), default=5, help="steps")
    add("--batch", type=at_least(1), default=32, help="global batch size")
    add("--lr", type=positive_float, default=0.1, help="learning rate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--a", required=True, metavar="STEP", type=compared_step,
        help="the teacher: module:factory of a step, or a towers/reference configuration")
    add("--b", required=True, metavar="STEP", type=compared_step, help="the step under test")
    add("--towers", type=at_least(1), default=4, help="towers of both runs")
    add("--bound", type=positive_float, default=None, metavar="TOL",
        help="a tolerance per element (needed for optimizers other than plain SGD between "
        "steps that are not both towers trainers)")
    add("--variables", choices=VARIABLES, default="replicated", help="placement of towers runs")
    add_problem_arguments(parser)


def digits_problem(model: str) -> tuple[Callable[[], Any], tuple[Any, ...]]:
    """The bundled digits' model factory (``mlp``: 64-32-10 on flat images, else the CNN) and
    ``(x, y, x_test, y_test)``."""
    from towers.training.data import digits
    from towers.training.models import digits_cnn, mlp

    x, y, x_test, y_test = digits()
    if model != "mlp":
        return digits_cnn, (x, y, x_test, y_test)
    flat = (x.reshape(len(x), -1), y, x_test.reshape(len(x_test), -1), y_test)
    return (lambda: mlp((64, 32, 10))), flat


def _arrays(args: argparse.Namespace) -> tuple[Any, Any]:
    import numpy as np

    if args.data is None:
        return digits_problem(args.model)[1][:2]
    with np.load(args.data) as arrays:
        if "x" not in arrays or "y" not in arrays:
            raise ValueError(f"--data {args.data}: expected arrays 'x' and 'y', got "
                             f"{sorted(arrays)}")
        x, y = arrays["x"], arrays["y"]
    if len(x) != len(y):
        raise ValueError(f"--data {args.data}: x has {len(x)} rows and y {len(y)}")
    return x, y


def factory(spec: str, argument: str) -> Callable[..., Any]:
    """The callable ``module:NAME`` names (TypeError: something else)."""
    from towers.allreduce.machinery.resolve import imported

    fn = imported(spec, argument)
    if not callable(fn):
        raise TypeError(f"{argument} {spec} is a {type(fn).__name__}, not a callable")
    return fn  # type: ignore[no-any-return]


def load_problem(args: argparse.Namespace) -> tuple[Any, ...]:
    """``(model_fn, optimizer_fn, loss, batches)`` from the options (ValueError: bad ones)."""
    import keras

    x, y = _arrays(args)
    if args.batch * args.steps > len(x):
        raise ValueError(f"--batch × --steps must be at most {len(x)} (the training set), got "
                         f"{args.batch} × {args.steps}")
    try:
        keras.optimizers.get({"class_name": args.optimizer, "config": {}})
        loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                if args.loss is None else keras.losses.get(args.loss))
    except ValueError as err:
        raise ValueError(f"--optimizer/--loss: {err}") from None

    def optimizer_fn() -> Any:
        return keras.optimizers.get({"class_name": args.optimizer,
                                     "config": {"learning_rate": args.lr}})

    data = [(x[k:k + args.batch], y[k:k + args.batch])
            for k in range(0, args.batch * args.steps, args.batch)]
    model_fn = (digits_problem(args.model)[0] if args.model in ("mlp", "conv")
                else factory(args.model, "--model"))
    return model_fn, optimizer_fn, loss, data


def _binds(obj: Any, *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(obj).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return True


def _load_side_step(spec: str, problem: tuple[Any, ...], devices: list[str],
                    variables: str) -> Any:
    from towers.allreduce.machinery.resolve import get, imported, label
    from towers.testing.compare import Config, config

    if ":" in spec and not spec.startswith("towers:"):
        obj = imported(spec, "side")
        if _binds(obj, *problem[:3], devices) and not _binds(obj, [], op="sum"):
            return obj(*problem[:3], devices)
    side = config(spec)  # checks "towers:NAME"
    if side.reference:
        return side
    return Config(get(side.all_reduce, argument="all_reduce", devices=devices), variables,
                  label=label(side.all_reduce))


def exit_code(report: Any) -> int:
    """0 within the bound, 3 only kernel noise, 1 a real difference."""
    if report.ok:
        return 0
    if hasattr(report, "reduction_ok"):
        return KERNEL_NOISE if report.reduction_ok else 1
    first = report.first
    return KERNEL_NOISE if first is not None and first.cause == "kernels" else 1


def run(args: argparse.Namespace) -> int:
    """Run ``towers compare`` or ``towers bisect`` on the two steps; returns an exit code."""
    from towers.trace.schedule import start_devices

    command = args.towers_command
    devices = start_devices(args.towers)  # first: before TensorFlow's runtime starts
    model_fn, optimizer_fn, loss, batches = problem = load_problem(args)
    a, b = (_load_side_step(s, problem, devices, args.variables) for s in (args.a, args.b))
    from towers import testing

    if command == "bisect":
        print(f"towers bisect: {args.a} vs {args.b}, {args.model}, {args.towers} towers, "
              f"batch {args.batch}, up to {args.steps} steps")
    report = getattr(testing, command)(
        a, b, batches, bound=args.bound, loss=loss, towers=args.towers, steps=args.steps,
        model_fn=model_fn, optimizer_fn=optimizer_fn)
    print(report)
    return exit_code(report)
