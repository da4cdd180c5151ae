"""The README's performance table quotes the run in benchmarks/: every target's value there."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_quotes_the_benchmark_run_it_ships() -> None:
    results = json.loads((ROOT / "benchmarks" / "bench.json").read_text())
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Performance"):readme.index("## Layout")]
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
    """README and docs/performance.md show the default step's ratios to
    CentralStorageStrategy, guarded/unguarded × barrier/inlined: the run's numbers."""
    results = json.loads((ROOT / "benchmarks" / "bench.json").read_text())
    names = {"conv-mnist": "conv-MNIST", "mlp": "wide MLP"}
    order = [("skip", "nested"), ("ignore", "nested"), ("skip", "inlined"), ("ignore", "inlined")]
    for model, label in names.items():
        rows = {(r["on_nonfinite"], r["update"]): r["vs_css"] for r in results["guard"]
                if r["model"] == model and r["config"] == "towers naive/parameter_device"}
        line = f"| {label} | " + " | ".join(f"{rows[k]:.3f}" for k in order) + " |"
        for page in ("README.md", "docs/performance.md"):
            assert line in (ROOT / page).read_text(), (page, line)
