"""The ``towers`` command line: ``python -m towers <command>``.

Commands:
    train     train a CNN on the bundled digits over simulated towers and compare with
              MirroredStrategy.
    trace     run one all-reduce, print its tick table and draw its schedule.
    check     check an all-reduce against the contract with Hypothesis.
    timeline  write one training step as a Perfetto / chrome://tracing timeline.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from towers import check_job, timeline_job, trace_job, train_job

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
    trace = sub.add_parser(
        "trace",
        help="run one all-reduce, print its tick table and draw its schedule",
        description=trace_job.__doc__,
        epilog=trace_job.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    trace_job.add_arguments(trace)
    trace.set_defaults(func=trace_job.run)
    check = sub.add_parser(
        "check",
        help="check an all-reduce against the contract with Hypothesis",
        description=check_job.__doc__,
        epilog=check_job.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check_job.add_arguments(check)
    check.set_defaults(func=check_job.run)
    timeline = sub.add_parser(
        "timeline",
        help="write one training step as a Perfetto / chrome://tracing timeline",
        description=timeline_job.__doc__,
        epilog=timeline_job.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    timeline_job.add_arguments(timeline)
    timeline.set_defaults(func=timeline_job.run)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command."""
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
