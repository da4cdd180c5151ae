"""Every example runs as a user would run it (its own process, its own device count).

Each gets small flags so the three together stay well under a minute on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_hand_ring_prints_every_tick_and_matches_numpy() -> None:
    out = _run("hand_ring.py", "--towers", "4", "--size", "8")
    for tick in range(6):
        assert f"tick {tick}  {'reduce-scatter' if tick < 3 else 'all-gather'}" in out
    assert out.count(" -> tower ") == 6 * 4
    assert "bytes sent per tower: [48, 48, 48, 48] (2(n-1)/n·S = 48)" in out
    assert "towers bitwise identical: True" in out and "OK: the hand-written ring" in out


@pytest.mark.long
def test_custom_reduction_is_checked_then_trains() -> None:
    out = _run("custom_reduction.py", "--steps", "3", "--examples", "8")
    assert "PASS: bidirectional_ring (8 examples run)" in out
    assert "bytes not checked" not in out  # its bytes_sent formula was checked
    losses = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and all(0 < loss < 5 for loss in losses)
    assert "6 ticks per all-reduce" in out


@pytest.mark.long
def test_equivalence_check_is_bitwise() -> None:
    out = _run("equivalence_check.py", "--steps", "2")
    assert out.count("max abs error 0  (0 ULP)") == 6  # every weight of the model
    assert "OK: every weight is bitwise equal to MirroredStrategy's" in out


@pytest.mark.parametrize("script", ["hand_ring.py", "custom_reduction.py", "equivalence_check.py"])
def test_examples_say_what_they_teach_and_simulate_devices_first(script: str) -> None:
    source = (ROOT / "examples" / script).read_text()
    assert source.startswith('"""') and "What it teaches" in source
    main = source[source.index("def main"):]
    before = main[: main.index("towers.simulate_devices(")]  # in main, before the devices
    top_level = [line for line in source.splitlines() if line.startswith(("import", "from"))]
    for lines in (before, "\n".join(top_level)):
        assert "import tensorflow" not in lines and "import keras" not in lines
