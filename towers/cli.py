"""The ``towers`` command line: ``python -m towers <command>``.

Commands:
    train   train a CNN on the bundled digits over simulated towers and compare with
            MirroredStrategy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from towers import train_job

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    top = argparse.ArgumentParser(
        prog="towers", description="Exact, teachable data-parallel training in TensorFlow."
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train a CNN on digits over simulated towers",
        description=train_job.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train_job.add_arguments(train)
    train.set_defaults(func=train_job.run)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command."""
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
