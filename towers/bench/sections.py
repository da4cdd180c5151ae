"""The sections of ``towers bench``: run one, print its tables, write its files.

Each section takes the parsed arguments, the simulated devices and the shared
``results`` dict, stores its rows there, and returns False when a result is
wrong (``#wrong`` > 0 or first losses that disagree), True otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from towers.bench import report, training
from towers.bench.allreduce import QUICK_SIZES, SIZES, cost_rows, run_allreduce
from towers.bench.costmodel import fitting
from towers.bench.costmodel.paper import paper_section
from towers.bench.memory import memory_section
from towers.bench.phases import phases_section
from towers.bench.pipeline import pipeline_section
from towers.bench.profile import op_profile, summarize
from towers.bench.timing import load_average
from towers.bench.xla import xla_section

__all__ = ["SECTION", "fit_measured", "save_json"]

LOSS_TOLERANCE = 1e-4
QUICK_STEP_ALGORITHMS = ("naive", "parameter_device", "ring", "tree")
"""Towers algorithms in the training table under ``--quick`` (all registered otherwise)."""


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


def _errors(compared: list[dict[str, Any]], prefix: str) -> dict[str, float | None]:
    errors = [abs(c["rel_error"]) for c in compared if not c.get("train")]
    return {f"{prefix}median_error": statistics.median(errors) if errors else None,
            f"{prefix}max_error": max(errors) if errors else None}


def fit_measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per contender of the all-reduce table: α and the per-byte cost fitted to its times.

    Every all-reduce formula moves twice the bytes it reduces, so its rows fix α and
    ``2β + γ`` only (reported as a bandwidth, ``1 / (2β + γ)``). The ``send``/``add``
    rows would split β from γ, but on logical CPUs their call overhead would dominate
    the fit, so they are left out. ``fit_*``: the error of a fit to every size, on those
    sizes (how well the formula's shape follows the rows); ``held_out_*``: fitted on
    every other size, the error on the sizes it did not see (a prediction).
    """
    modelled = [r for r in cost_rows(rows) if r["algorithm"] not in ("send", "add")]
    train = set(fitting.split_sizes([r["nbytes"] for r in modelled])[0])
    out = []
    for name in dict.fromkeys(r["name"] for r in modelled):
        own = [r for r in modelled if r["name"] == name]
        sizes = {r["nbytes"] for r in own}
        with warnings.catch_warnings():  # "only 2β + γ": expected, said in the docstring
            warnings.simplefilter("ignore")
            links = fitting.fit(own, per_algorithm=True)
            held = (fitting.holdout(own, train & sizes)
                    if len(train & sizes) >= 2 and sizes - train else [])  # fmt: skip
        link = links[own[0]["algorithm"]]
        out.append({"algorithm": name, "formula": own[0]["algorithm"], "alpha": link.alpha,
                    "per_byte": 2 * link.beta + link.gamma,
                    **_errors(fitting.compare(own, links), "fit_"),
                    **_errors(held, "held_out_")})
    return out


def costmodel_section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """α and ``2β + γ`` fitted per algorithm to the all-reduce rows, with the fit's error."""
    if not results.get("allreduce"):
        print("\n(cost model: needs the allreduce section)")
        return True
    _say("cost model: alpha-beta-gamma fitted per algorithm to its median times")
    rows = fit_measured(results["allreduce"])
    print(report.costmodel_table(rows))
    results["costmodel"] = rows
    report.write_csv(args.out / "costmodel.csv", rows)
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


SECTION: dict[str, Callable[[argparse.Namespace, list[str], dict], bool]] = {
    "allreduce": allreduce_section,
    "costmodel": costmodel_section,
    "training": training_section,
    "phases": phases_section,
    "memory": memory_section,
    "pipeline": pipeline_section,
    "paper": paper_section,
    "xla": xla_section,
}


def save_json(out: Path, results: dict[str, Any]) -> Path:
    """Everything in ``out/bench.json``."""
    return report.write_json(out / "bench.json", results)
