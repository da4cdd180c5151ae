"""The ``towers`` command line: ``python -m towers <command>``.

Commands:
    train     train a CNN on the bundled digits over simulated towers and compare with
              MirroredStrategy.
    trace     run one all-reduce, print its tick table and draw its schedule.
    check     check an all-reduce against the contract with Hypothesis.
    timeline  write one training step as a Perfetto / chrome://tracing timeline.
    bench     all-reduce and training-step benchmarks side by side with tf.distribute.
    launch    run a command once per task of a localhost cluster, each with its TF_CONFIG.
    invariance  check that training gives the same result on 1, 2, 4, 8 towers.
    bisect    find the first step, variable and element where two steps part.
    compare   compare two training steps (yours or towers') on every batch, teacher-forced.
    study     compare reducers and codecs: loss against gradient bytes and predicted time.

Each command lives in its own module with ``add_arguments(parser)`` and
``run(args) -> exit code``. Algorithms and codecs are a registered name or ``module:NAME``
in every command (:mod:`towers.cli.arguments`); a usage error is one line and exit
status 2, before any work. Nothing starts TensorFlow's runtime before a command runs,
so each can simulate the devices it needs first.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["COMMANDS", "main", "parser"]

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("towers.cli.train", "train a CNN on digits over simulated towers"),
    "trace": ("towers.cli.trace", "run one all-reduce, print its tick table and draw it"),
    "check": ("towers.cli.check", "check an all-reduce against the contract with Hypothesis"),
    "timeline": ("towers.cli.timeline", "write one training step as a chrome://tracing timeline"),
    "bench": ("towers.cli.bench", "benchmark all-reduce and training steps against tf.distribute"),
    "launch": ("towers.cli.launch", "run a command once per task of a localhost cluster"),
    "invariance": ("towers.cli.invariance", "check training is the same on 1, 2, 4, 8 towers"),
    "bisect": ("towers.cli.bisect", "find the first step and variable where two setups part"),
    "compare": ("towers.cli.compare", "compare two training steps, yours or towers', per step"),
    "study": ("towers.cli.study", "compare reducers and codecs: loss vs bytes and predicted time"),
}
"""Command name -> (module with add_arguments/run, one-line help)."""


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr, naming the option, and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    top = _Parser(
        prog="towers", description="Exact, teachable data-parallel training in TensorFlow."
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(func=module.run)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command."""
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
