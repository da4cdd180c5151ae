"""Between-graph training: ``towers launch`` runs examples/multi_worker.py on 2 workers × 2 towers.

Each worker trains with ``CrossWorker`` and, in the same process, with
MultiWorkerMirroredStrategy on the same global batches; the example prints the largest
weight difference and the rounding bound derived in its docstring (only the summation
order differs). The launch is bounded by --timeout and a subprocess timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent.parent
DIFF = re.compile(r"\[worker (\d)\] max \|towers - MultiWorkerMirroredStrategy\| = (\S+)"
                  r"  \(bound (\S+)\)")
STEP = re.compile(r"\[worker (\d)\] step (\d): worker batch 32  towers local loss (\S+)"
                  r"  MWMS global loss (\S+)")


@pytest.fixture(scope="module")
def output() -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "towers", "launch", "--workers", "2", "--towers-per-worker", "2",
         "--timeout", "150", "--", sys.executable, "examples/multi_worker.py", "--steps", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_weights_match_mwms_within_the_rounding_bound(output: str) -> None:
    found = {int(w): (float(d), float(b)) for w, d, b in DIFF.findall(output)}
    assert sorted(found) == [0, 1], output
    assert found[0] == found[1]  # every worker holds the same weights
    diff, bound = found[0]
    assert 0 < bound < 1e-5
    assert diff <= bound, f"difference {diff} above the bound {bound}"


def test_worker_losses_average_to_the_global_loss(output: str) -> None:
    steps: dict[int, dict[int, tuple[float, float]]] = {}
    for w, s, local, global_ in STEP.findall(output):
        steps.setdefault(int(s), {})[int(w)] = (float(local), float(global_))
    assert sorted(steps) == [0, 1], output
    for per_worker in steps.values():
        locals_ = [per_worker[k][0] for k in (0, 1)]
        assert per_worker[0][1] == per_worker[1][1]
        np.testing.assert_allclose(np.mean(locals_), per_worker[0][1], rtol=1e-6)
