"""Compare reducers and codecs: loss against gradient bytes and predicted communication time.

Trains the digits once per REDUCER from the same weights on the same batches; every step's
loss, test accuracy, gradient bytes and predicted time on 8 and 1024 H100s go to PREFIX.csv,
the curves to PREFIX.png.

A REDUCER is an all-reduce (``ring``), a codec over ring (``fp16``, ``topk(0.1)``,
``powersgd(4)``), a codec over another all-reduce (``powersgd(4)@halving_doubling``),
or your codec or all-reduce as ``module:NAME`` (``file.py:NAME``).

Exit status: 0 when every run trained, 1 when one failed, 2 for bad options.
"""

from __future__ import annotations

import argparse
import sys

from towers.cli.arguments import at_least, output_prefix, positive_float, reducer
from towers.cli.compare import digits_problem

__all__ = ["EPILOG", "add_arguments", "run"]

EPILOG = """examples:
  python -m towers study ring fp16 "topk(0.1)" "powersgd(4)"
  python -m towers study ring "powersgd(2)@halving_doubling" --towers 8 --epochs 3
  python -m towers study ring my_codecs.py:sign --out results/sign
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("reducers", nargs="*", metavar="REDUCER", type=reducer,
        default=["ring", "fp16", "topk(0.1)", "powersgd(4)"],
        help='what to compare (default: ring fp16 "topk(0.1)" "powersgd(4)")')
    add("--towers", type=at_least(2), default=4, help="simulated devices, at least 2")
    add("--model", choices=("cnn", "mlp"), default="cnn",
        help="cnn (the digits CNN, default) or mlp (64-32-10)")
    add("--epochs", type=at_least(1), default=1, help="epochs")
    add("--batch", type=at_least(1), default=64, help="global batch size")
    add("--lr", type=positive_float, default=3e-3, help="Adam learning rate")
    add("--steps", type=at_least(1), default=None,
        help="stop each run after this many steps (default: every epoch)")
    add("--eval-every", type=at_least(1), default=1, help="test accuracy every this many steps")
    add("--out", type=output_prefix, default="study", metavar="PREFIX",
        help="writes PREFIX.csv and PREFIX.png")


def run(args: argparse.Namespace) -> int:
    from towers.trace.schedule import start_devices

    devices = start_devices(args.towers)  # first: before TensorFlow's runtime starts
    from towers.allreduce.machinery.resolve import parse
    from towers.bench import study

    for spec in args.reducers:
        parse(spec)
    model, data = digits_problem(args.model)
    if args.batch > len(data[0]):
        raise ValueError(f"--batch {args.batch} is more than the {len(data[0])} examples")
    print(f"towers study: {', '.join(args.reducers)} on {args.towers} towers, {args.model}, "
          f"{args.epochs} epoch(s) of batch {args.batch}, Adam {args.lr:g}", flush=True)
    try:
        rows = study.run_study(
            args.reducers, devices, model=model, data=data, epochs=args.epochs,
            batch_size=args.batch, learning_rate=args.lr, eval_every=args.eval_every,
            steps=args.steps,
            progress=lambda line: print("  " + line, flush=True),
        )
    except Exception as err:  # a user's reducer failed while training
        print(f"towers study: a run failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print()
    print(study.summary_table(rows))
    print(f"\nsteps: {study.write_csv(rows, args.out + '.csv')}")
    print(f"curves: {study.plot(rows, args.out + '.png')}")
    return 0
