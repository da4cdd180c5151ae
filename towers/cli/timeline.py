"""Write one training step as a timeline for Perfetto (ui.perfetto.dev) or chrome://tracing.

A small CNN on the bundled digits trains over simulated towers with ``TowerTrainer``; its
phases are compiled one by one and timed (median of --repeats runs): forward and backward
per tower (split by the profiler's op times), the all-reduce, and the apply, laid out as
the step orders them; each all-reduce tick sits on the towers that send or receive in it.

What the numbers mean: forward, backward, apply and the whole all-reduce are measured; a
tick's length is the all-reduce's time split by the bytes each tick moves (a model);
positions are derived. The whole compiled step, measured too, is shorter than the phases
end to end: pieces compiled apart each pay a call's overhead and cannot overlap.
"""

from __future__ import annotations

import argparse
import json
import sys

from towers.cli.arguments import VARIABLES, algorithm, at_least, output_file

__all__ = ["EPILOG", "add_arguments", "run", "usage_problem"]

EPILOG = """examples:
  python -m towers timeline                                  # 4 towers, ring
  python -m towers timeline --towers 8 --algorithm tree --out tree_step.json
  python -m towers timeline --variables parameter_device --algorithm naive
  python -m towers timeline --algorithm my_algos:star --repeats 20
  python -m towers timeline --measured step.png              # profiler ops vs the model

Open the JSON at https://ui.perfetto.dev (Open trace file) or in chrome://tracing.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--towers", type=at_least(1), default=4, help="simulated devices")
    add("--algorithm", type=algorithm, default="ring",
        help="a registered name or module:function")
    add("--variables", default="replicated", choices=VARIABLES, help="variable placement")
    add("--batch-size", type=at_least(1), default=64,
        help="global batch, at least one example per tower")
    add("--repeats", type=at_least(1), default=5,
        help="timed runs per phase; the median is used")
    add("--out", type=output_file, default="timeline.json", help="output")
    add("--seed", type=at_least(0), default=0, help="seed for weights and the batch")
    add("--measured", metavar="PNG", type=output_file, default=None,
        help="also draw the profiler's op events of one real step (measured) above the "
        "modelled timeline")


def usage_problem(args: argparse.Namespace) -> str | None:
    if args.batch_size < args.towers:
        return (f"argument --batch-size: {args.batch_size} leaves some of the {args.towers} "
                "towers without an example; give at least --towers")
    return None


def run(args: argparse.Namespace) -> int:
    from towers.trace import schedule

    devices = schedule.start_devices(args.towers)  # first: before TensorFlow's runtime starts
    from towers.trace.timeline import OpEvent, build_timeline, draw_measured

    print(f"towers timeline: one step of digits_cnn, batch {args.batch_size}, {args.towers} "
          f"towers, all_reduce={args.algorithm}, variables={args.variables}")
    data, report = build_timeline(devices, algorithm=args.algorithm, variables=args.variables,
                                  batch_size=args.batch_size, repeats=args.repeats,
                                  seed=args.seed)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(report)
    count = sum(e["ph"] == "X" for e in data["traceEvents"])
    print(f"wrote {args.out}: {count} events (open at https://ui.perfetto.dev or chrome://tracing)")
    if args.measured:
        ops = [OpEvent(*e) for e in data["measuredOps"]]
        if not ops:
            print("towers timeline: no profiler events to draw", file=sys.stderr)
            return 1
        print(f"measured: {draw_measured(ops, args.towers, args.measured, modelled=data)} "
              f"({len(ops)} op events of one profiled step)")
    return 0
