"""docs/benchmarks.md quotes the run in benchmarks/: every target's value there."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from towers.bench import floors

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_quote_the_benchmark_run_they_ship() -> None:
    results = json.loads((ROOT / "benchmarks" / "bench.json").read_text())
    section = (ROOT / "docs" / "benchmarks.md").read_text()
    quoted = [t for t in results["targets"] if not t["target"].startswith("cost model")]
    # 3 all-reduce targets, one per chunked schedule (6), 4 per model (2 models), the
    # guard's share per model and placement (2 x 2)
    assert len(quoted) == 3 + 6 + 2 * 4 + 2 * 2
    for target in quoted:
        name = target["target"].replace(">=", "≥").replace("<=", "≤").replace(" x ", " × ")
        rows = [line for line in section.splitlines() if line.startswith(f"| {name} |")]
        assert len(rows) == 1, (name, rows)  # one row per target, named as the run names it
        verdict = "yes" if target["holds"] else "no"
        assert rows[0].rstrip().endswith(f"| {target['value']:.2f} | {verdict} |"), (target, rows)


def test_the_exactness_table_quotes_the_guard_section_of_that_run() -> None:
    """docs/benchmarks.md and docs/performance.md show the default step's ratios to
    CentralStorageStrategy, guarded/unguarded × barrier/inlined: the run's numbers."""
    results = json.loads((ROOT / "benchmarks" / "bench.json").read_text())
    names = {"conv-mnist": "conv-MNIST", "mlp": "wide MLP"}
    order = [("skip", "nested"), ("ignore", "nested"), ("skip", "inlined"), ("ignore", "inlined")]
    for model, label in names.items():
        rows = {(r["on_nonfinite"], r["update"]): r["vs_css"] for r in results["guard"]
                if r["model"] == model and r["config"] == "towers naive/parameter_device"}
        line = f"| {label} | " + " | ".join(f"{rows[k]:.3f}" for k in order) + " |"
        for page in ("docs/benchmarks.md", "docs/performance.md"):
            assert line in (ROOT / page).read_text(), (page, line)


def test_the_pipeline_table_and_the_chunked_timings_quote_that_run() -> None:
    """docs/step.md's input-pipeline table is benchmarks/pipeline.csv; docs/benchmarks.md's
    chunked-schedule bullet quotes the same run's 64 MB times and calibration ratios."""
    readme = (ROOT / "docs" / "step.md").read_text()
    with (ROOT / "benchmarks" / "pipeline.csv").open() as f:
        rows = list(csv.DictReader(f))
    names = {"conv-mnist": "conv-mnist", "mlp": "wide MLP"}
    order = ["host slicing", "pipeline multi_device", "pipeline per_device", "fixed batch",
             "fixed shards"]
    for model, label in names.items():
        got = {r["config"]: r for r in rows if r["model"] == model}
        cells = [f"{float(got[c]['ms']):.1f} ms ({float(got[c]['ratio']):.3f})" for c in order]
        assert f"| {label} | " + " | ".join(cells) + " |" in readme, (model, cells)
    results = json.loads((ROOT / "benchmarks" / "bench.json").read_text())
    size = max(r["size"] for r in results["allreduce"])
    us = {r["algorithm"]: r["time_us"] for r in results["allreduce"] if r["size"] == size}
    chunked = [us[a] / 1e3 for a in ("ring", "swing", "bruck", "pat", "torus_2d",
                                     "halving_doubling")]
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    bullet = page[page.index("- *Chunked schedules*"):page.index("- *XLA*")]
    assert f"{min(chunked):.1f}–{max(chunked):.1f} ms at 64 MB" in bullet
    assert f"naive's {us['naive'] / 1e3:.1f} ms" in bullet
    ratios = [t / (us["naive"] / 1e3) for t in chunked]
    assert f"{min(ratios):.2f}–{max(ratios):.2f}×" in bullet
    flat = " ".join(bullet.split())
    for part in (floors.LEAF_ADDS, floors.CHAIN_ADDS, floors.ASSEMBLY):
        assert f"`{part}` {us[part] / us['naive']:.2f}×" in flat, part
    shares = {r["algorithm"]: r["leaf_share"] for r in results["allreduce"]
              if r["size"] == size and r.get("chunked")}  # fmt: skip
    of_parts = [us[a] / floors.in_sequence(shares[a], 4, us) for a in shares]
    assert f"{min(of_parts):.2f}–{max(of_parts):.2f} of its parts" in flat


def test_the_profile_and_xla_bullets_quote_that_run() -> None:
    """docs/benchmarks.md's step-vs-CentralStorageStrategy and XLA bullets quote the same
    run's profiled wall times, guard thread time and XLA rows."""
    results = json.loads((ROOT / "benchmarks" / "bench.json").read_text())
    readme = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    phase = {(p["model"], p["config"]): p for p in results["phases"]}
    towers, css = "towers naive/parameter_device", "CentralStorageStrategy"
    walls = [f"{phase[(m, towers)]['wall_ms']:.1f} against {phase[(m, css)]['wall_ms']:.1f}"
             for m in ("mlp", "conv-mnist")]
    assert f"({walls[0]} ms on the MLP; {walls[1]} on conv-MNIST)" in readme
    assert f"{phase[('mlp', towers)]['guard']:.1f} thread ms of a" in readme
    xla = {(r["model"], r["config"]): r for r in results["xla"]}
    conv = [xla[("conv-mnist", f"towers naive/{p} +XLA")]["ratio"]
            for p in ("parameter_device", "replicated")]
    assert (f"MirroredStrategy+XLA {xla[('conv-mnist', 'MirroredStrategy +XLA')]['ratio']:.2f}×, "
            f"towers+XLA {min(conv):.2f}–{max(conv):.2f}×") in readme
    ours, theirs = xla[("mlp", f"{towers} +XLA")]["ms"], xla[("mlp", "MirroredStrategy +XLA")]["ms"]
    assert f"{ours / theirs:.2f}× in this one ({ours:.1f} against {theirs:.1f} ms)" in readme
    assert xla[("mlp", f"{css} +XLA")]["error"]  # "CentralStorageStrategy with XLA fails"
