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
