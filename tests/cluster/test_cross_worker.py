"""CrossWorker: one worker equals naive bitwise; the checks; a missing worker times out.

``AllTowers`` in one process: bitwise MirroredStrategy's CollectiveAllReduce. With one
worker its group is the process's T towers, and MirroredStrategy over logical
CPUs runs the very code MWMS runs per worker (``CollectiveAllReduce``: reversed, packed,
one ring ``all_reduce_v2``), so a ``TowerTrainer`` on ``AllTowers(1, op="sum")`` must end
with bitwise its weights. ``"ring"`` (towers' own ring: chunks per variable) need not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import towers
from reference import MirroredTrainer
from tests.cluster.train_worker import make_model
from tests.conftest import DEVICES
from towers.allreduce import GradientReducer
from towers.cluster.cross_worker import AllTowers, CrossWorker


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


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _train(trainer: object, batches: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    for b in batches:
        x = rng.random((b, 8, 8, 1), dtype=np.float32)
        y = rng.integers(0, 10, b).astype(np.int32)
        trainer.train_step(x, y)  # type: ignore[attr-defined]
    return trainer.get_weights() if hasattr(trainer, "get_weights") else \
        trainer.model.get_weights()  # type: ignore[attr-defined]


@pytest.mark.parametrize("n", [2, 3])
def test_all_towers_is_bitwise_mirrored_strategy(n: int) -> None:
    batches = [64, 10, 3]  # 10 over 3 → 4, 3, 3; 3 over 2 → 2, 1
    mine = _train(towers.TowerTrainer(make_model, keras.optimizers.SGD(0.1), LOSS,
                                      devices=DEVICES[:n], variables="replicated",
                                      all_reduce=AllTowers(1, op="sum")), batches)
    ref = _train(MirroredTrainer(make_model, keras.optimizers.SGD(0.1), LOSS,
                                 devices=DEVICES[:n]), batches)
    for a, b in zip(mine, ref, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_workers": 0}, "num_workers"), ({"num_workers": True}, "num_workers"),
    ({"op": "max"}, "op"), ({"timeout_seconds": 0}, "timeout_seconds"),
    ({"communication_hint": "nccl"}, "communication_hint"),
])
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AllTowers(**{"num_workers": 2, **kwargs})


def test_reduce_before_build_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="build"):
        AllTowers(2).reduce_gradients([[]])
    assert AllTowers(3).summation_depth(2) == 5


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_workers": 0}, "num_workers"), ({"timeout_seconds": -1}, "timeout_seconds"),
    ({"all_reduce": AllTowers(2, op="mean")}, "op='sum'"),
])
def test_worker_trainer_refuses_bad_arguments(kwargs: dict, match: str) -> None:
    from towers.cluster.cross_worker import WorkerTrainer

    with pytest.raises(ValueError, match=match):
        WorkerTrainer(make_model, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:2],
                      **{"num_workers": 2, **kwargs})


def test_worker_slice_refuses_bad_arguments() -> None:
    from towers.cluster.cross_worker import worker_slice

    with pytest.raises(ValueError, match="worker"):
        worker_slice(4, 2, 2)
    with pytest.raises(ValueError, match="batch_size"):
        worker_slice(-1, 2, 0)
