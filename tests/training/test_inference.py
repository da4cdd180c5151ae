"""towers.training.inference: evaluate's loss holds the model's own losses (add_loss in
call, activity regularizers), read inside the traced pass, as MirroredStrategy reports."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class WithOwnLosses(keras.Model):
    """An activity regularizer and an ``add_loss`` of the activations in ``call``."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.hidden = keras.layers.Dense(8, activation="relu",
                                         activity_regularizer=keras.regularizers.L1(0.01))
        self.out = keras.layers.Dense(3)

    def call(self, x: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        h = self.hidden(x)
        self.add_loss(0.01 * tf.reduce_mean(tf.square(h)))
        return self.out(h)


def _model(weights: list[np.ndarray] | None = None) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = WithOwnLosses()
    model(np.zeros((1, 6), "f4"))
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.mark.long
@pytest.mark.parametrize("variables", ["replicated", "parameter_device"])
def test_evaluate_reports_the_models_own_losses_as_mirrored_strategy(variables: str) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 6)).astype("f4"), np.arange(12) % 3
    tm = towers.TowerModel(_model(), devices=DEVICES[:4], variables=variables)
    tm.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    # a short last batch (10 + 2: shards 3, 3, 2, 2 and 1, 1, 0, 0); validation used to fail
    history = tm.fit(x, y, batch_size=10, verbose=0, validation_data=(x, y), epochs=2)
    got = tm.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    assert got["loss"] == history.history["val_loss"][-1]
    assert np.isfinite(history.history["loss"]).all()
    # the reference: MirroredStrategy's evaluate of this model fails itself on shards of
    # unequal size (an AddN of [3, 6] and [1, 6] inputs, measured), so it gets 3 + 3 + 3 + 3
    got = tm.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)
    with tf.distribute.MirroredStrategy(
        DEVICES[:4], cross_device_ops=tf.distribute.ReductionToOneDevice()
    ).scope():
        reference = _model(tm.get_weights())
        reference.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    want = reference.evaluate(x, y, batch_size=12, verbose=0, return_dict=True)
    without = _model(tm.get_weights())
    without.compile(keras.optimizers.SGD(0.1), LOSS)
    data_only = float(np.mean(LOSS(y, without(x), sample_weight=None)))  # no model losses
    assert got["accuracy"] == want["accuracy"]
    # the same sums in other orders (per-replica trackers and regularizers): float32
    # roundings apart; the model's own losses alone move the loss far more than that
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    assert abs(got["loss"] - data_only) > 1e-3
