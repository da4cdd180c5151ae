"""Small models and data shared by the TowerModel tests (towers/model.py)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

import towers
from tests.conftest import DEVICES

N = 3  # three towers: a batch of 10 splits 4, 3, 3 and the mean of three is not exact


def network(seed: int = 0) -> keras.Model:
    """5 -> 8 (relu) -> 3 logits."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def data(n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("f4"), rng.integers(0, 3, size=n)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tower_model(variables: str = "replicated", optimizer: Any = None, seed: int = 0,
                **options: Any) -> towers.TowerModel:
    """A compiled TowerModel over N towers (SGD 0.1 unless told)."""
    all_reduce = options.pop("all_reduce", "ring" if variables != "parameter_device" else None)
    tm = towers.TowerModel(network(seed), devices=DEVICES[:N], variables=variables,
                           all_reduce=all_reduce, **options)  # fmt: skip
    tm.compile(optimizer or keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    return tm


def assert_replicas_equal(tm: towers.TowerModel) -> None:
    """Every replica holds bitwise tm's weights."""
    assert tm.trainer is not None
    want = tm.get_weights()
    for weights in tm.trainer.replica_weights():
        for got, expected in zip(weights, want, strict=True):
            np.testing.assert_array_equal(got, expected)


def reset(tm: towers.TowerModel, weights: list[np.ndarray], learning_rate: float = 0.1) -> None:
    """Put a shared TowerModel back to ``weights`` and a fresh run (its traces are kept)."""
    tm.set_weights(weights)
    tm.optimizer.learning_rate = learning_rate
    tm.stop_training = False
    tm._initial_epoch = None  # BackupAndRestore's resume point (Keras keeps it on the model)
