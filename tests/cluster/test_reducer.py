"""CrossWorker in one process (one worker): the local sum in tower order, the checks."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import towers
from towers.allreduce import GradientReducer
from towers.cluster.reducer import CrossWorker

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
