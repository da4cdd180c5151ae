"""Trace one all-reduce on simulated towers: the tick table, a summary and a picture.

Runs the algorithm once on --size float32 elements per tower and records every ``send``
(tick, from, to, chunk, bytes, operation); the summary checks bytes and result. The PNG draws
towers × ticks, one arrow per transfer (* : a tick assigned by order; dashed: opaque).

Exit status: 0 when the result matches NumPy, 1 when it does not (or the algorithm
raised), 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import sys

from towers.cli.arguments import OPS, algorithm_or_collective, at_least, output_file

__all__ = ["EPILOG", "add_arguments", "run", "usage_problem"]

EPILOG = """examples:
  python -m towers trace --algorithm ring --towers 4
  python -m towers trace ring --n 8 --html ring.html        # step through it in a browser
  python -m towers trace halving_doubling --n 8 --state hd.png
  python -m towers trace --algorithm tree --towers 7 --size 28 --out tree.png
  python -m towers trace --algorithm halving_doubling --towers 6 --op max
  python -m towers trace --algorithm hierarchical --towers 8 --ticks order
  python -m towers trace --algorithm my_algos:star --json star.json     # ./my_algos.py
  python -m towers trace --algorithm my_algos.py:make_star               # a factory
  python -m towers trace --collective broadcast --algorithm chain --towers 5
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("name", nargs="?", metavar="ALGO", type=algorithm_or_collective, default=None,
        help="the algorithm, as --algorithm (either, not both)")
    add("--algorithm", type=algorithm_or_collective, default=None,
        help="a registered name (default ring) or module:function / file.py:function; a "
        "factory (anything not taking (values, *, op)) is called with no arguments")
    add("--collective", default=None, choices=("reduce_scatter", "all_gather", "broadcast"),
        help="print this collective's schedule for --algorithm instead")
    add("--towers", "--n", type=at_least(1), default=4, help="simulated devices")
    add("--size", type=at_least(1), default=16, help="float32 elements per tower")
    add("--op", default="sum", choices=OPS, help="the reduction")
    add("--out", metavar="PNG", type=output_file, default=None,
        help="where to draw the picture (default: <algorithm>.png, unless --state, --html or "
        "--json is given)")
    add("--no-png", action="store_true", help="print the table only")
    add("--state", metavar="PNG", type=output_file, default=None,
        help="also draw the links and every tower's chunk state per tick")
    add("--html", metavar="PAGE", type=output_file, default=None,
        help="also write the step-through viewer (one self-contained HTML page)")
    add("--json", metavar="PATH", type=output_file, default=None,
        help="also write the transfers, rows, bytes and result as JSON")
    add("--ticks", default="algorithm", choices=("algorithm", "order"),
        help="algorithm: the ticks the algorithm annotates; order: reassign every tick by "
        "order (one send and one receive per tower per tick, after its data arrives)")


def usage_problem(args: argparse.Namespace) -> str | None:
    if args.name and args.algorithm and args.name != args.algorithm:
        return f"ALGO {args.name!r} and --algorithm {args.algorithm!r} disagree: give one"
    return None


def _state(args: argparse.Namespace, fn: object, devices: list[str]) -> None:
    from towers.trace import draw_state, trace_state, write_html

    state = trace_state(fn, devices)  # type: ignore[arg-type]
    print(f"state: {len(state.segments)} chunks, {state.ticks} ticks, alpha {state.messages} "
          f"messages (cost formula: {state.alpha}), complete at the end: {state.complete()}")
    if args.state:
        print(f"state picture: {draw_state(state, args.state)}")
    if args.html:
        print(f"viewer: {write_html(state, args.html)} (open it in a browser; keys: arrows)")


def run(args: argparse.Namespace) -> int:
    args.algorithm = args.algorithm or args.name or "ring"
    if args.collective:
        from towers.allreduce.collectives import format_collective

        print(format_collective(args.collective, args.algorithm, args.towers, 4 * args.size))
        return 0
    from towers.trace import schedule

    devices = schedule.start_devices(args.towers)  # first: before TensorFlow's runtime starts
    from towers.allreduce.machinery.resolve import label
    from towers.trace import draw, format_summary, format_table, to_json

    name, fn = label(args.algorithm), schedule.resolve(args.algorithm, devices)
    try:
        trace = schedule.trace_all_reduce(fn, devices, size=args.size, op=args.op,
                                          by_order=args.ticks == "order", name=name)
    except Exception as err:
        print(f"towers trace: {name} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(f"towers trace: {name} on {args.towers} towers {devices}\n\n{format_table(trace)}\n\n"
          f"{format_summary(trace)}")
    if not args.no_png and (args.out or not (args.state or args.html or args.json)):
        stem = args.algorithm.rsplit(":", 1)[-1].replace(".", "_") or "trace"
        print(f"picture: {draw(trace, args.out or f'{stem}.png')}")
    if args.state or args.html:
        try:
            _state(args, fn, devices)
        except ValueError as err:
            print(f"towers trace: {name}: no state: {err}", file=sys.stderr)
            return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(trace), f, indent=1)
        print(f"transfers: {args.json}")
    return 0 if trace.ok else 1
