"""Writes through the Keras model reach every replica and the next step, for every placement.

Weights set or loaded, an optimizer hyperparameter changed by a callback (learning rate,
weight decay) and a layer frozen: after each, every replica holds the same values and the
next step trains with the change (compared bitwise with a model built with it).
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

import towers
from tests.model.helpers import assert_replicas_equal, data, reset, tower_model

X, Y = data(20)
PLACEMENTS = ["parameter_device", "replicated", "sharded"]
_SHARED: dict[str, tuple[towers.TowerModel, list[np.ndarray]]] = {}


def _model(variables: str) -> towers.TowerModel:
    """One TowerModel per placement for this module (traced once), reset to its start."""
    if variables not in _SHARED:
        tm = tower_model(variables, all_reduce="ring" if variables == "sharded" else None)
        _SHARED[variables] = tm, tm.get_weights()
    reset(*_SHARED[variables])
    return _SHARED[variables][0]


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("variables", PLACEMENTS)
def test_set_weights_and_load_weights_reach_every_replica(variables: str, tmp_path: Path) -> None:
    tm = _model(variables)
    tm.fit(X, Y, batch_size=10, verbose=0)
    start = [w * 0 + 0.5 for w in tm.get_weights()]
    tm.set_weights(start)
    assert_replicas_equal(tm)
    _assert_same(tm.get_weights(), start)
    tm.save_weights(tmp_path / "start.weights.h5")
    tm.fit(X, Y, batch_size=10, verbose=0)
    tm.load_weights(tmp_path / "start.weights.h5")
    assert_replicas_equal(tm)
    _assert_same(tm.get_weights(), start)


@pytest.mark.parametrize("variables", PLACEMENTS)
def test_a_learning_rate_callback_reaches_every_replica(variables: str) -> None:
    tm = _model(variables)
    before = tm.get_weights()
    zero = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.0)
    tm.fit(X, Y, batch_size=10, epochs=1, shuffle=False, callbacks=[zero], verbose=0)
    _assert_same(tm.get_weights(), before)  # lr 0 on every replica: nothing moved
    assert tm.trainer is not None
    assert all(float(r.optimizer.learning_rate) == 0.0 for r in tm.trainer.replicas)


# replicated: the copy to every replica and the retrace (the only step for one replica)
@pytest.mark.parametrize("variables", ["replicated"])
def test_weight_decay_set_by_a_callback_retraces_the_step(variables: str) -> None:
    def decay(epoch: int, logs: object) -> None:
        if epoch == 1:
            tm.optimizer.weight_decay = 0.5

    tm = _model(variables)
    tm.optimizer.weight_decay = None
    tm.fit(X, Y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    decayed = tower_model(variables, optimizer=keras.optimizers.SGD(0.1, weight_decay=0.5),
                          all_reduce="ring" if variables == "sharded" else None)
    decayed.set_weights(tm.get_weights())
    tm.fit(X, Y, batch_size=20, epochs=2, initial_epoch=1, shuffle=False, verbose=0,
           callbacks=[keras.callbacks.LambdaCallback(on_epoch_begin=decay)])
    decayed.fit(X, Y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    _assert_same(tm.get_weights(), decayed.get_weights())
    tm.optimizer.weight_decay = None
    assert_replicas_equal(tm)


@pytest.mark.parametrize("variables", ["parameter_device", "replicated"])
def test_a_frozen_layer_stays_put_on_every_replica(variables: str) -> None:
    tm = _model(variables)
    tm.fit(X, Y, batch_size=10, verbose=0)
    hidden = [w.numpy() for w in tm.network.get_layer("hidden").weights]
    tm.network.get_layer("hidden").trainable = False
    try:
        tm.fit(X, Y, batch_size=10, verbose=0)
        _assert_same([w.numpy() for w in tm.network.get_layer("hidden").weights], hidden)
        assert_replicas_equal(tm)
    finally:
        tm.network.get_layer("hidden").trainable = True


def test_freezing_under_sharded_is_refused_naming_it() -> None:
    tm = _model("sharded")
    tm.network.get_layer("hidden").trainable = False
    try:
        with pytest.raises(ValueError, match="sharded"):
            tm.fit(X, Y, batch_size=10, verbose=0)
    finally:
        tm.network.get_layer("hidden").trainable = True
