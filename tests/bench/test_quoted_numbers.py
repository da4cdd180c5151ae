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
    # 3 all-reduce targets, one per chunked schedule (6), 4 per model (2 models)
    assert len(quoted) == 3 + 6 + 2 * 4
    for target in quoted:
        assert f"{target['value']:.2f}" in section, target
        verdict = "yes" if target["holds"] else "no"
        row = next(line for line in section.splitlines() if f"{target['value']:.2f}" in line)
        assert row.rstrip().endswith(f"| {verdict} |"), (target, row)
