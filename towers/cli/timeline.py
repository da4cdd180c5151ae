"""``towers timeline``: the command (options, writing and checking the JSON).

Its description is :mod:`towers.trace.timeline`'s docstring, which does the measuring and
the layout; it is read from the source, so ``--help`` imports no TensorFlow.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

from towers.cli.arguments import algorithm, output_file
from towers.cli.train import at_least

__all__ = ["EPILOG", "add_arguments", "run", "usage_problem"]

__doc__ = ast.get_docstring(ast.parse(
    (Path(__file__).resolve().parents[1] / "trace" / "timeline.py").read_text())) or __doc__

EPILOG = """examples:
  python -m towers timeline                                  # 4 towers, ring
  python -m towers timeline --towers 8 --algorithm tree --out tree_step.json
  python -m towers timeline --variables parameter_device --algorithm naive
  python -m towers timeline --algorithm my_algos:star --repeats 20
  python -m towers timeline --measured step.png              # profiler ops vs the model

Open the JSON at https://ui.perfetto.dev (Open trace file) or in chrome://tracing.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``towers timeline``."""
    parser.add_argument("--towers", type=at_least(1), default=4,
                        help="simulated devices (default 4)")
    parser.add_argument("--algorithm", type=algorithm, default="ring",
                        help="a registered name (default ring) or module:function")
    parser.add_argument("--variables", default="replicated",
                        choices=("replicated", "parameter_device"),
                        help="variable placement (default replicated)")
    parser.add_argument("--batch-size", type=at_least(1), default=64,
                        help="global batch, at least one example per tower (default 64)")
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="timed runs per phase; the median is used (default 5)")
    parser.add_argument("--out", type=output_file, default="timeline.json",
                        help="output (default timeline.json)")
    parser.add_argument("--seed", type=at_least(0), default=0,
                        help="seed for weights and the batch")
    parser.add_argument("--measured", metavar="PNG", type=output_file, default=None,
                        help="also draw the profiler's op events of one real step (measured) "
                        "above the modelled timeline")


def usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options (None: nothing), before TensorFlow is imported."""
    if args.batch_size < args.towers:
        return (f"argument --batch-size: {args.batch_size} leaves some of the {args.towers} "
                "towers without an example; give at least --towers")
    return None


def run(args: argparse.Namespace) -> int:
    """Run the job; returns a process exit code."""
    from towers.trace.schedule import start_devices

    devices = start_devices(args.towers)  # first thing: before TensorFlow's runtime starts
    from towers.trace.timeline import build_timeline, validate

    print(f"towers timeline: one step of digits_cnn, batch {args.batch_size}, {args.towers} "
          f"towers, all_reduce={args.algorithm}, variables={args.variables}")
    try:
        data, report = build_timeline(args, devices)
    except (ValueError, TypeError) as err:  # an unknown algorithm, a bad model/batch
        print(f"towers timeline: error: {err}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    with open(args.out) as f:
        validate(json.load(f), args.towers, data["otherData"]["ticks"])
    print(report)
    count = sum(e["ph"] == "X" for e in data["traceEvents"])
    print(f"wrote {args.out}: {count} events (open at https://ui.perfetto.dev or chrome://tracing)")
    if args.measured:
        from towers.trace.measured import OpEvent, draw_measured

        ops = [OpEvent(*e) for e in data["measuredOps"]]
        if not ops:
            print("towers timeline: no profiler events to draw", file=sys.stderr)
            return 1
        print(f"measured: {draw_measured(ops, args.towers, args.measured, modelled=data)} "
              f"({len(ops)} op events of one profiled step)")
    return 0
