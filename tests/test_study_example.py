"""examples/study_codecs.py runs as a user runs it (own process, 4 simulated devices).

``--steps 1`` trains one step per reducer (about 13 s of CPU on 2 cores, most of it
tracing four steps); the full run is docs/codecs.md's table.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # a long proof: python -m pytest -m long

ROOT = Path(__file__).resolve().parents[1]


def test_study_example_compares_the_four_reducers(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "study_codecs.py"), "--steps", "1",
         "--out", str(tmp_path / "s")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with open(tmp_path / "s.csv") as f:
        rows = {r["reducer"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["ring", "fp16", "topk(0.1)", "powersgd(4)"]
    sent = {name: int(r["gradient_bytes_per_tower"]) for name, r in rows.items()}
    assert sent["powersgd(4)"] < sent["topk(0.1)"] < sent["fp16"] < sent["ring"]
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in rows:
        assert name in done.stdout  # the summary table
