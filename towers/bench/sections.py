"""The sections of ``towers bench``: run one, print its tables, write its files.

Each section takes the parsed arguments, the simulated devices and the shared
``results`` dict, stores its rows there, and returns False when a result is
wrong (``#wrong`` > 0 or first losses that disagree), True otherwise.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from towers.bench import report, training
from towers.bench.allreduce import QUICK_SIZES, SIZES, run_allreduce
from towers.bench.costcheck import TOLERANCE, check_cost_model, split_sizes
from towers.bench.costmodel.paper import paper_section
from towers.bench.guard import guard_section
from towers.bench.memory import memory_section
from towers.bench.opcount import opcount_section
from towers.bench.phases import phases_section
from towers.bench.pipeline import pipeline_section
from towers.bench.profile import op_profile, summarize
from towers.bench.scaling import LINEAR_SLOPE, TOWERS, fit_slopes, run_scaling
from towers.bench.timing import load_average
from towers.bench.xla import xla_section

__all__ = ["SECTION", "save_json"]

LOSS_TOLERANCE = 1e-4
QUICK_STEP_ALGORITHMS = ("naive", "parameter_device", "ring", "tree")
"""Towers algorithms in the training table under ``--quick`` (all registered otherwise)."""
QUICK_SCALING_ALGORITHMS = ("naive", "ring", "tree", "halving_doubling", "nccl")
"""Under ``--quick``, one algorithm of each growth shape (linear, n², n log n, opaque)."""


def _towers_names(args: argparse.Namespace, quick: tuple[str, ...] | None = None) -> Any:
    """The registry names from ``--algorithms`` (tf.* names are all-reduce-table only)."""
    if args.algorithms is None:
        return list(quick) if quick and args.quick else None
    return [a for a in args.algorithms if not a.startswith("tf.")]


def _say(title: str) -> None:
    load = ", ".join(f"{v:.2f}" for v in load_average())
    print(f"\n== {title}  (load average {load})", flush=True)


def allreduce_section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """The nccl-tests style table, the algbw pivot and its plot."""
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    rounds = args.rounds or (9 if args.quick else 15)
    tables = devices[: args.towers]
    _say(f"all-reduce, {len(tables)} towers, float32 sum, {sizes[0]}..{sizes[-1]} B per tower")
    rows = run_allreduce(tables, sizes, algorithms=args.algorithms, rounds=rounds,
                         verbose=not args.quiet)
    print(f"# time = median of interleaved rounds; busbw = algbw * 2(n-1)/n, n = {len(tables)}")
    print(report.allreduce_table(rows))
    print("\nalgbw (GB/s), algorithms side by side:")
    print(report.algbw_pivot(rows))
    results["allreduce"] = rows
    results["allreduce_load"] = load_average()
    report.write_csv(args.out / "allreduce.csv", rows)
    if not args.no_plots:
        report.plot_algbw(rows, args.out / "allreduce_algbw.png",
                          f"all-reduce over {len(tables)} simulated devices (float32 sum)")
    wrong = [r for r in rows if r.get("wrong")]
    for r in wrong:
        print(f"WRONG: {r['algorithm']} at {r['size']} B: {r['wrong']} elements")
    return not wrong


def costmodel_section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """Fit α-β-γ per algorithm to the all-reduce rows: in-sample and on held-out sizes."""
    if not results.get("allreduce"):
        print("\n(cost model: needs the allreduce section)")
        return True
    _say("cost model: alpha-beta-gamma fitted per algorithm to its median times")
    details, summary = check_cost_model(results["allreduce"])
    splits = split_sizes(results["allreduce"])
    print(report.costmodel_tables(details, summary, splits, TOLERANCE))
    results["costmodel"] = summary
    results["costmodel_splits"] = {how: {"train": train, "held_out": test}
                                   for how, (train, test) in splits.items()}
    report.write_csv(args.out / "costmodel.csv", details)
    return True


def _profile(configs: dict[str, Callable[[], Any]], verbose: bool) -> dict[str, Any]:
    """:func:`towers.bench.profile.op_profile` of each step (after one warm-up call)."""
    out = {}
    for name, step in configs.items():
        step()
        out[name] = op_profile(step)
        if verbose:
            print(f"  {name}: {summarize(out[name])}")
    return out


def _losses_agree(rows: list[dict]) -> bool:
    ok = True
    for model in dict.fromkeys(r["model"] for r in rows):
        losses = [r["first_loss"] for r in rows if r["model"] == model and r["first_loss"]]
        if losses and max(losses) - min(losses) > LOSS_TOLERANCE * max(1.0, abs(losses[0])):
            print(f"WRONG: first-step losses of {model} disagree: {min(losses)}..{max(losses)}")
            ok = False
    return ok


def training_section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """The step table (ms, ratio to Mirrored and to the best tf.distribute) and its plot."""
    models = args.models or list(training.MODELS)
    rounds = args.step_rounds or (5 if args.quick else 13)
    tables = devices[: args.towers]
    rows: list[dict] = []
    profiles: dict[str, Any] = {}
    for model in models:
        _say(f"training step: {model}, batch {args.batch_size}, SGD, {len(tables)} towers")
        options = {"algorithms": _towers_names(args, QUICK_STEP_ALGORITHMS), "rounds": rounds,
                   "verbose": not args.quiet, "batch": args.batch_size}
        if args.placements:
            options["placements"] = args.placements
        if not args.quick and args.algorithms is None:
            options["extra"] = training.fused_reducers()
        if args.profile:
            options["profile"] = profiles.setdefault(model, {})
        rows.extend(_run_model(training, model, tables, options))
    print()
    print(report.training_table(rows))
    results["training"] = rows
    results["training_load"] = load_average()
    if profiles:
        results["profile"] = profiles
    report.write_csv(args.out / "training.csv", rows)
    if not args.no_plots:
        report.plot_ratios(rows, args.out / "training_ratio.png")
    return _losses_agree(rows)


def _run_model(training: Any, model: str, devices: list[str], options: dict) -> list[dict]:
    profile = options.pop("profile", None)
    rows = training.run_model(model, devices, **options)
    if profile is not None:
        picks = _profile_picks(rows)
        print(f"profile ({model}): thread time per step by phase and op type")
        steps = training.profile_steps(model, devices, picks, batch=options.get("batch", 256))
        profile.update(_profile(steps, verbose=True))
    return list(rows)


def _profile_picks(rows: list[dict]) -> list[str]:
    timed = [r for r in rows if r.get("ms")]
    best = min((r for r in timed if r["kind"] == "towers"), key=lambda r: r["ms"], default=None)
    picks = [r["config"] for r in timed if r["kind"] in ("baseline", "tf.distribute")]
    return picks + ([best["config"]] if best else [])


def scaling_section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """Trace seconds and graph ops against towers × buckets, with fitted slopes."""
    counts = args.scaling_towers or (TOWERS[:3] if args.quick else TOWERS)
    _say(f"scaling: one step traced for {counts} towers")
    rows = run_scaling(devices, towers=counts,
                       algorithms=_towers_names(args, QUICK_SCALING_ALGORITHMS),
                       verbose=not args.quiet)
    columns: list[report.Column] = [
        ("algorithm\n", "l", lambda r: r["algorithm"]),
        ("towers\n", "r", lambda r: str(r["towers"])),
        ("buckets\n", "r", lambda r: str(r["buckets"])),
        ("graph\nops", "r", lambda r: str(r["ops"] or "-")),
        ("sends\n", "r", lambda r: str(r["sends"] or "-")),
        ("trace\n(s)", "r", lambda r: f"{r['trace_s']:.2f}" if r["trace_s"] else "-"),
    ]
    print(report.format_table(columns, rows))
    slopes = fit_slopes(rows)
    slope_columns: list[report.Column] = [
        ("algorithm\n", "l", lambda r: r["algorithm"]),
        ("ops\nslope", "r", lambda r: f"{r['ops_slope']:.2f}"),
        ("sends\nslope", "r", lambda r: f"{r['sends_slope']:.2f}" if r["sends_slope"] else "-"),
        ("trace\nslope", "r", lambda r: f"{r['trace_slope']:.2f}"),
        ("towers\nexponent", "r", lambda r: _fmt(r["towers_exponent"])),
        ("buckets\nexponent", "r", lambda r: _fmt(r["buckets_exponent"])),
        ("ops per\ntower*bucket", "r", lambda r: f"{r['ops_per_unit']:.1f}"),
        (f"linear\n(<= {LINEAR_SLOPE})", "r", lambda r: "yes" if r["linear"] else "NO"),
    ]
    print("\ngrowth: log-log slopes against towers x buckets over all points, and local "
          "exponents of ops\nin towers (two largest counts) and buckets (1 = linear):")
    print(report.format_table(slope_columns, slopes))
    results["scaling"] = rows
    results["scaling_slopes"] = slopes
    report.write_csv(args.out / "scaling.csv", rows)
    if not args.no_plots:
        report.plot_graph_cost(rows, args.out / "graph_cost.png")
    return True


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


SECTION: dict[str, Callable[[argparse.Namespace, list[str], dict], bool]] = {
    "allreduce": allreduce_section,
    "costmodel": costmodel_section,
    "training": training_section,
    "scaling": scaling_section,
    "phases": phases_section,
    "memory": memory_section,
    "pipeline": pipeline_section,
    "paper": paper_section,
    "guard": guard_section,
    "opcount": opcount_section,
    "xla": xla_section,
}


def save_json(out: Path, results: dict[str, Any]) -> Path:
    """Everything in ``out/bench.json``."""
    return report.write_json(out / "bench.json", results)
