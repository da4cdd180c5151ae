"""The fit / custom-loop examples run as a user runs them: own process, 4 simulated devices."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["custom_loop_digits.py", "fit_digits.py"]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.long
def test_custom_loop_trains_counts_bytes_and_resumes() -> None:
    out = _run("custom_loop_digits.py", "--epochs", "2")
    losses = [float(m) for m in re.findall(r"^epoch \d/2  loss (\S+)", out, re.MULTILINE)]
    assert len(losses) == 2 and losses[1] < losses[0]
    accuracy = float(re.findall(r"test accuracy (\S+)", out)[-1])
    assert accuracy > 0.85
    sent = re.search(r"each tower sent \[(.*)\]", out)
    assert sent is not None and all(int(b) > 0 for b in sent.group(1).split(","))
    assert "restored at step 46: bitwise equal True" in out  # 2 epochs of 23 batches


@pytest.mark.long
def test_fit_example_stops_early_logs_and_evaluates() -> None:
    out = _run("fit_digits.py")
    trained = int(re.search(r"trained (\d+) epochs", out).group(1))  # type: ignore[union-attr]
    assert 3 <= trained < 20 and "early stopping" in out  # EarlyStopping ended it
    assert f"CSVLogger wrote {trained} epochs" in out
    assert out.count(" - val_accuracy: ") == trained  # verbose=2: one line per epoch
    accuracy = float(re.search(r"test accuracy (\S+)", out).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.9
    predicted = re.search(r"predicted \[(.*)\]", out).group(1)  # type: ignore[union-attr]
    labels = re.search(r"labels    \[(.*)\]", out).group(1)  # type: ignore[union-attr]
    agree = sum(p == t for p, t in zip(predicted.split(","), labels.split(",")))
    assert agree >= 10


@pytest.mark.parametrize("script", SCRIPTS)
def test_examples_say_what_they_teach_and_simulate_devices_first(script: str) -> None:
    source = (ROOT / "examples" / script).read_text()
    assert source.startswith('"""') and "What it teaches" in source
    before = source[: source.index("towers.simulate_devices(")]
    assert "import tensorflow" not in before and "import keras" not in before
