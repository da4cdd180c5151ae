"""Between-graph training: ``towers launch`` runs examples/multi_worker.py on 2 workers × T.

Each worker trains twice in one process, beside MultiWorkerMirroredStrategy (MWMS) on
the same global batches: ``TowerTrainer`` + ``CrossWorker`` (towers first, then workers)
within the rounding bound derived in the example's docstring, and ``WorkerTrainer`` +
``AllTowers`` (MWMS's own summation order) bitwise equal. T = 1 and 2. Each launch is
bounded by its timeout.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cluster.conftest import Run, launch_workers

pytestmark = pytest.mark.long  # a long proof: python -m pytest -m long

ROOT = Path(__file__).parent.parent.parent
DIFF = re.compile(r"\[worker (\d)\] max \|towers - MultiWorkerMirroredStrategy\| = (\S+)"
                  r"  \(bound (\S+)\)")
BITWISE = re.compile(r"\[worker (\d)\] order (\w+): max \|towers - MWMS\| = (\S+); "
                     r"bitwise equal: (\w+)")
STEP = re.compile(r"\[worker (\d)\] step (\d): worker batch 32  towers local loss (\S+)"
                  r"  towers MWMS-order loss (\S+)  MWMS global loss (\S+)")


@pytest.fixture(scope="module", params=[1, 2], ids=["T1", "T2"])
def output(request: pytest.FixtureRequest) -> str:
    run: Run = launch_workers(
        [sys.executable, str(ROOT / "examples" / "multi_worker.py"), "--steps", "2"],
        towers=request.param, timeout=150)
    assert run.code == 0, run.out[-4000:]
    return run.out


def test_weights_match_mwms_within_the_rounding_bound(output: str) -> None:
    found = {int(w): (float(d), float(b)) for w, d, b in DIFF.findall(output)}
    assert sorted(found) == [0, 1], output
    assert found[0] == found[1]  # every worker holds the same weights
    diff, bound = found[0]
    assert 0 < bound < 1e-5
    assert diff <= bound, f"difference {diff} above the bound {bound}"


def test_mwms_order_is_bitwise_equal_to_mwms(output: str) -> None:
    found = {(int(w), order): (float(d), same) for w, order, d, same in BITWISE.findall(output)}
    assert sorted(found) == [(0, "local"), (0, "mwms"), (1, "local"), (1, "mwms")], output
    for w in (0, 1):
        assert found[w, "mwms"] == (0.0, "True")


def test_worker_losses_add_up_to_the_global_loss(output: str) -> None:
    steps: dict[int, dict[int, tuple[float, ...]]] = {}
    for w, s, *losses in STEP.findall(output):
        steps.setdefault(int(s), {})[int(w)] = tuple(map(float, losses))
    assert sorted(steps) == [0, 1], output
    for per_worker in steps.values():
        assert per_worker[0][2] == per_worker[1][2]
        global_ = per_worker[0][2]
        np.testing.assert_allclose(np.mean([per_worker[k][0] for k in (0, 1)]), global_, rtol=1e-6)
        np.testing.assert_allclose(sum(per_worker[k][1] for k in (0, 1)), global_, rtol=1e-6)
