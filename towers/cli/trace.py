"""Trace one all-reduce on simulated towers: the tick table, a summary and a picture.

Runs the algorithm once, eagerly, on --size float32 elements per tower (tower i
holds i·size + [0, 1, …], so sums are exact), inside ``towers.allreduce.record()``:
every ``send`` becomes one row of the tick table (tick, source tower, destination
tower, chunk, bytes, operation). The summary gives the bytes each tower sent
(against the algorithm's ``bytes_sent`` formula when it has one), the ticks, which
tower finished which chunk, and the result checked against NumPy. The PNG shows
towers as rows and ticks as columns, one arrow per transfer coloured by chunk, a
star where a chunk is first complete, and at the right the chunks each tower holds
at the end. The PNG is drawn to --out, or to ``<algorithm>.png`` when no other output
(--state, --html, --json) is asked for: files appear only where asked.

Ticks are the algorithm's own; transfers without one (tick=None) get one by order
(marked *). Opaque collectives (nccl, nccl_ring, nccl_tree) move data outside
``send``; their estimated traffic is shown dashed and marked estimated.

``--state PNG`` draws every tower's chunk state tick by tick beside the links
(:mod:`towers.trace.picture`); ``--html PAGE`` writes the step-through viewer, one
self-contained page to open in any browser (:mod:`towers.trace.viewer`). Both run
the algorithm on labelled inputs (op sum, ``n·2^⌈log2 n⌉`` elements per tower) and
read what each send carries.

``--collective reduce_scatter|all_gather|broadcast`` prints that collective's
schedule for ``--algorithm`` instead (text only: ticks, drawing, bytes, cost).

Exit status: 0 when the result matches NumPy, 1 when it does not (or the
algorithm raised), 2 for an unknown algorithm or bad options.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from towers.cli.arguments import algorithm_or_collective, output_file
from towers.cli.train import at_least

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

An unknown name lists the registered ones (towers.ALGORITHMS).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``towers trace``."""
    parser.add_argument("name", nargs="?", metavar="ALGO", type=algorithm_or_collective,
                        default=None, help="the algorithm, as --algorithm (either, not both)")
    parser.add_argument(
        "--algorithm", type=algorithm_or_collective, default=None,
        help="a registered name (default ring) or module:function / file.py:function; a "
        "factory (anything not taking (values, *, op)) is called with no arguments",
    )
    parser.add_argument("--collective", default=None,
                        choices=("reduce_scatter", "all_gather", "broadcast"),
                        help="print this collective's schedule for --algorithm instead")
    parser.add_argument("--towers", "--n", type=at_least(1), default=4,
                        help="simulated devices (default 4)")
    parser.add_argument("--size", type=at_least(1), default=16,
                        help="float32 elements per tower (default 16)")
    parser.add_argument("--op", default="sum", choices=("sum", "mean", "max", "min"),
                        help="the reduction (default sum)")
    parser.add_argument("--out", metavar="PNG", type=output_file, default=None,
                        help="where to draw the picture (default: <algorithm>.png, unless "
                        "--state, --html or --json is given)")
    parser.add_argument("--no-png", action="store_true", help="print the table only")
    parser.add_argument("--state", metavar="PNG", type=output_file, default=None,
                        help="also draw the links and every tower's chunk state per tick")
    parser.add_argument("--html", metavar="PAGE", type=output_file, default=None,
                        help="also write the step-through viewer (one self-contained HTML page)")
    parser.add_argument("--json", metavar="PATH", type=output_file, default=None,
                        help="also write the transfers, rows, bytes and result as JSON")
    parser.add_argument(
        "--ticks", default="algorithm", choices=("algorithm", "order"),
        help="algorithm: the ticks the algorithm annotates (default); order: reassign every "
        "tick by order (one send and one receive per tower per tick, after its data arrives)",
    )


def _default_png(algorithm: str) -> str:
    stem = algorithm.rsplit(":", 1)[-1].replace(".", "_") or "trace"
    return f"{stem}.png"


def usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options (None: nothing), before TensorFlow is imported."""
    if args.name and args.algorithm and args.name != args.algorithm:
        return f"ALGO {args.name!r} and --algorithm {args.algorithm!r} disagree: give one"
    return None


def _png(args: argparse.Namespace) -> str | None:
    """Where to draw the tick picture: --out, else the default unless another output was
    asked for (or --no-png)."""
    if args.no_png or (args.out is None and (args.state or args.html or args.json)):
        return None
    return str(args.out or _default_png(args.algorithm))


def _state_outputs(args: argparse.Namespace, fn: Any, devices: list[str]) -> None:
    from towers.trace.picture import draw_state
    from towers.trace.state import trace_state
    from towers.trace.viewer import write_html

    state = trace_state(fn, devices)
    print(f"state: {len(state.segments)} chunks, {state.ticks} ticks, alpha {state.messages} "
          f"messages (cost formula: {state.alpha}), complete at the end: {state.complete()}")
    if args.state:
        print(f"state picture: {draw_state(state, args.state)}")
    if args.html:
        print(f"viewer: {write_html(state, args.html)} (open it in a browser; keys: arrows)")


def _collective(args: argparse.Namespace) -> int:
    """``--collective``: print that collective's schedule (text only)."""
    from towers.allreduce.collectives import format_collective

    try:
        print(format_collective(args.collective, args.algorithm, args.towers, 4 * args.size))
    except ValueError as err:
        print(f"towers trace: error: {err}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the job; returns a process exit code."""
    args.algorithm = args.algorithm or args.name or "ring"
    if args.collective:
        return _collective(args)
    from towers.trace.schedule import start_devices

    devices = start_devices(args.towers)  # first thing: before TensorFlow's runtime starts
    from towers import trace as tracing
    from towers.allreduce.machinery.resolve import get, label

    try:
        name = label(args.algorithm)
        fn = get(args.algorithm, argument="algorithm", devices=devices)
    except (ValueError, TypeError) as err:
        print(f"towers trace: error: {err}", file=sys.stderr)
        return 2
    try:
        trace = tracing.trace_all_reduce(
            fn, devices, size=args.size, op=args.op, by_order=args.ticks == "order", name=name
        )
    except Exception as err:
        print(f"towers trace: {name} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(f"towers trace: {name} on {args.towers} towers {devices}\n")
    print(tracing.format_table(trace))
    print()
    print(tracing.format_summary(trace))
    png = _png(args)
    if png:
        print(f"picture: {tracing.draw(trace, png)}")
    if args.state or args.html:
        try:
            _state_outputs(args, fn, devices)
        except ValueError as err:
            print(f"towers trace: {name}: no state: {err}", file=sys.stderr)
            return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(tracing.to_json(trace), f, indent=1)
        print(f"transfers: {args.json}")
    return 0 if trace.ok else 1
