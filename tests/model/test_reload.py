"""Reload and interoperate: a saved TowerModel whose optimizer holds a value Keras does
not let anyone set (a ``LearningRateSchedule``) reloads and trains on as the
uninterrupted run, bitwise.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

from tests.model.helpers import assert_replicas_equal, data, network, tower_model

X, Y = data(20)

SCHEDULES = {
    "exponential": lambda: keras.optimizers.schedules.ExponentialDecay(0.05, 3, 0.5),
    "cosine": lambda: keras.optimizers.schedules.CosineDecay(0.05, 10),
    "piecewise": lambda: keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.05, 0.01]),
    "inverse_time": lambda: keras.optimizers.schedules.InverseTimeDecay(0.05, 2, 0.5),
    "polynomial": lambda: keras.optimizers.schedules.PolynomialDecay(0.05, 8, 0.001),
}


@pytest.mark.long
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_model_with_a_schedule_reloads_and_trains_on(schedule: str, optimizer: str,
                                                        tmp_path: Path) -> None:  # fmt: skip
    def make() -> keras.optimizers.Optimizer:
        kind = keras.optimizers.SGD if optimizer == "sgd" else keras.optimizers.Adam
        return kind(SCHEDULES[schedule]())

    straight = tower_model("replicated", optimizer=make())
    straight.fit(X, Y, batch_size=5, shuffle=False, verbose=0)
    straight.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for model in (straight, loaded):
        model.fit(X, Y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    assert_replicas_equal(loaded)
    for a, b in zip(straight.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("variables", ["replicated", "parameter_device", "sharded"])
def test_weights_files_move_between_towers_and_plain_keras(variables: str,
                                                           tmp_path: Path) -> None:  # fmt: skip
    tm = tower_model(variables)
    tm.fit(X, Y, batch_size=10, verbose=0)
    tm.save_weights(tmp_path / "towers.weights.h5")
    plain = network(seed=9)
    plain.load_weights(tmp_path / "towers.weights.h5")
    for a, b in zip(plain.get_weights(), tm.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(plain.predict(X, verbose=0), tm.predict(X, verbose=0),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    # and back: a plain model's weights into a TowerModel, on every replica
    plain_trained = network(seed=5)
    plain_trained.save_weights(tmp_path / "plain.weights.h5")
    tm.load_weights(tmp_path / "plain.weights.h5")
    for a, b in zip(tm.get_weights(), plain_trained.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    tm.fit(X, Y, batch_size=10, verbose=0)
    assert_replicas_equal(tm)
