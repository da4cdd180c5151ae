"""towers.training.sync: a callback's optimizer change reaches every replica's optimizer,
a wrapper's inner optimizer included (LossScaleOptimizer)."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np

import towers
from tests.conftest import DEVICES
from tests.model.helpers import LOSS, assert_replicas_equal, data, network

X, Y = data(12)


def _loss_scaled() -> towers.TowerModel:
    tm = towers.TowerModel(network(1), devices=DEVICES[:2], variables="replicated")
    tm.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), LOSS)
    return tm


def test_a_scheduled_rate_reaches_every_replicas_inner_optimizer() -> None:
    tm = _loss_scaled()
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5**epoch)
    tm.fit(X, Y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[schedule])
    assert tm.trainer is not None
    for replica in tm.trainer.replicas:  # an optimizer, not its config dict
        inner = replica.optimizer.inner_optimizer
        assert isinstance(inner, keras.optimizers.SGD)
        np.testing.assert_allclose(float(inner.learning_rate.numpy()), 0.025, rtol=1e-6)
    assert_replicas_equal(tm)


def test_a_loaded_loss_scaled_model_trains_on(tmp_path: Path) -> None:
    tm = _loss_scaled()
    tm.fit(X, Y, batch_size=4, shuffle=False, verbose=0)
    tm.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    before = loaded.get_weights()
    loaded.fit(X, Y, batch_size=4, shuffle=False, verbose=0)
    assert any(not np.array_equal(a, b) for a, b in zip(loaded.get_weights(), before))
    assert_replicas_equal(loaded)
