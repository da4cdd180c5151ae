"""CrossWorker: one worker equals naive bitwise; the checks; a missing worker times out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import towers
from towers.allreduce import GradientReducer
from towers.cluster.cross_worker import CrossWorker

from ..conftest import DEVICES


def _model() -> keras.Model:
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, kernel_initializer=init(1)),
                             keras.layers.Dense(3, kernel_initializer=init(2))])


def test_one_worker_equals_naive_bitwise() -> None:
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(10, 5)).astype("float32"),
                rng.normal(size=(10, 3)).astype("float32")) for _ in range(2)]
    weights = []
    for algorithm in ("naive", CrossWorker(1)):
        trainer = towers.TowerTrainer(_model, lambda: keras.optimizers.SGD(0.1), "mse",
                                      devices=DEVICES[:4], all_reduce=algorithm,
                                      variables="replicated")
        for x, y in batches:
            trainer.train_step(x, y)
        weights.append(trainer.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_is_a_gradient_reducer_and_checks_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    reducer = CrossWorker(2)
    assert isinstance(reducer, GradientReducer)
    assert reducer.summation_depth(2) == 2
    with pytest.raises(RuntimeError, match="build"):
        reducer.reduce_gradients([[]])
    with pytest.raises(ValueError, match="num_workers"):
        CrossWorker(0)
    with pytest.raises(ValueError, match="op must be"):
        CrossWorker(1, op="max")
    with pytest.raises(ValueError, match="timeout_seconds"):
        CrossWorker(1, timeout_seconds=0)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        CrossWorker()


@pytest.mark.long
def test_a_missing_worker_is_an_error_within_the_timeout() -> None:
    root = Path(__file__).parent.parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "lone_worker.py")],
                          env=env, capture_output=True, text=True, timeout=120)
    line = next((s for s in done.stdout.splitlines() if s.startswith(("ERROR", "NO ERROR"))), "")
    # the collective's DeadlineExceeded reaches the user as towers' own StepTimeout
    assert line.startswith("ERROR StepTimeout"), done.stdout + done.stderr[-3000:]
    assert float(line.split()[-1]) < 30  # CrossWorker(timeout_seconds=3), not a hang
