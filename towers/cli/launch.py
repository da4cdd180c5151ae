"""Run a command once per task of a localhost cluster, each with its own TF_CONFIG.

Starts --workers workers (and --ps servers) on 127.0.0.1, each with ``TF_CONFIG`` and
``TOWERS_PER_TASK``; lines are prefixed ``[worker 0]``. If one task fails the others end
after --failure-grace seconds; --timeout ends all.

Exit status: 0 when every worker exits 0, 124 after --timeout, otherwise the largest
exit code of a task that ended by itself; 2 for bad options.
"""

from __future__ import annotations

import argparse

from towers.cli.arguments import at_least, positive_float

__all__ = ["EPILOG", "add_arguments", "run", "usage_problem"]

EPILOG = """examples:
  python -m towers launch --workers 2 --towers-per-worker 2 -- python examples/multi_worker.py
  python -m towers launch --workers 2 --timeout 60 -- python -c "import os; print(os.environ)"
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--workers", type=at_least(1), default=2, help="worker tasks")
    add("--towers-per-worker", type=at_least(1), default=1, help="logical devices per task")
    add("--ps", type=at_least(0), default=0, help="parameter-server tasks")
    add("--timeout", type=positive_float, default=None,
        help="seconds before every task is killed (exit 124)")
    add("--failure-grace", type=float, default=0.0, help="seconds the rest run after a failure")
    add("command", nargs=argparse.REMAINDER, help="after --: the program and its arguments")


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    return command[1:] if command[:1] == ["--"] else command


def usage_problem(args: argparse.Namespace) -> str | None:
    problems = [] if _command(args) else ["give the command after --"]
    if args.failure_grace < 0:
        problems.append("--failure-grace must be at least 0")
    return "; ".join(problems) or None


def run(args: argparse.Namespace) -> int:
    from towers.cluster.launcher import launch
    from towers.cluster.spec import local_cluster

    cluster = local_cluster(args.workers, ps=args.ps)
    return launch(cluster, args.towers_per_worker, _command(args), timeout=args.timeout,
                  failure_grace=args.failure_grace)
