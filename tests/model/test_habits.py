"""TowerModel as Keras users build and use models: a factory of a subclassed model, predict
before compile, sequence inputs in a short last batch under every placement.

References: the towers step itself (``TowerTrainer`` on the same batches, bitwise), Keras's
own ``predict`` (bitwise), and ``sharded`` against ``replicated`` (bitwise: the same
ring, the same order, docs/sharded.md).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from tests.model.helpers import LOSS, N, assert_replicas_equal, data, network

X, Y = data(20)


class Subclassed(keras.Model):
    """A subclassed model: ``keras.models.clone_model`` cannot copy it onto other towers."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        return self.out(self.hidden(x))


def subclassed() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = Subclassed()
    model(np.zeros((1, 5), "f4"))
    return model


@pytest.mark.long
@pytest.mark.parametrize("variables", ["replicated", "sharded"])
def test_a_factory_of_a_subclassed_model_makes_every_replica(variables: str) -> None:
    tm = towers.TowerModel(subclassed, devices=DEVICES[:N], variables=variables)
    tm.compile(keras.optimizers.Adam(0.01), LOSS)
    tm.fit(X, Y, batch_size=8, shuffle=False, verbose=0)  # 8, 8 and a short 4
    trainer = towers.TowerTrainer(subclassed, keras.optimizers.Adam(0.01), LOSS,
                                  devices=DEVICES[:N], variables=variables)  # fmt: skip
    for start in range(0, len(X), 8):
        trainer.train_step(X[start:start + 8], Y[start:start + 8])
    for a, b in zip(tm.get_weights(), trainer.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert_replicas_equal(tm)
    tm.compile(keras.optimizers.SGD(0.1), LOSS)  # a second compile starts from the network
    assert tm.trainer is not None and tm.trainer.model is tm.network


def test_predict_before_compile_is_keras_own_one_device_predict() -> None:
    tm = towers.TowerModel(network(), devices=DEVICES[:N], variables="replicated")
    want = network().predict(X, batch_size=8, verbose=0)
    np.testing.assert_array_equal(tm.predict(X, batch_size=8, verbose=0), want)
    assert tm.trainer is None  # nothing was built for the towers
    tm.compile(keras.optimizers.SGD(0.1), LOSS)  # then the towers predict
    # on shards of 3 and 3 rows (and 2, 1, 1) the CPU's matmul kernels may round a row
    # otherwise than in the batch of 8 (measured: 3 of 60 values, 1 ulp)
    np.testing.assert_allclose(tm.predict(X, batch_size=8, verbose=0), want, rtol=1e-6)


def _sequence_network() -> keras.Model:
    # a Dense on a [batch, T, C] input: its kernel's gradient loses its static shape when
    # the batch dimension is unknown (fit's trace of a short last batch)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 4))
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5, "tanh")(inputs))
    return keras.Model(inputs, keras.layers.Dense(3)(pooled))


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_sharded_fits_a_sequence_input_with_a_short_last_batch_as_replicated() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(10, 6, 4)).astype("f4"), rng.integers(0, 3, size=10)
    weights = []
    for variables in ("replicated", "sharded"):
        tm = towers.TowerModel(_sequence_network(), devices=DEVICES[:N], variables=variables,
                               all_reduce="ring")  # fmt: skip
        tm.compile(keras.optimizers.Adam(0.01), LOSS)
        tm.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)  # 4, 4, 2
        weights.append(tm.get_weights())
    for a, b in zip(*weights, strict=True):
        np.testing.assert_array_equal(a, b)


class DropsOut(keras.Model):
    """Dropout called without ``training``: Keras's call context tells it (model.__call__
    sets ``training=True`` for every inner layer during fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8)
        self.drop = keras.layers.Dropout(0.5)
        self.out = keras.layers.Dense(3)

    def call(self, x: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        return self.out(self.drop(self.hidden(x)))


def drops_out() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = DropsOut()
    model(np.zeros((1, 5), "f4"))
    return model


def test_inner_layers_train_as_under_keras_when_call_does_not_pass_training() -> None:
    one = drops_out()
    one.compile(keras.optimizers.SGD(0.1), LOSS)
    one.train_on_batch(X[:8], Y[:8])
    trainer = towers.TowerTrainer(drops_out, keras.optimizers.SGD(0.1), LOSS,
                                  devices=DEVICES[:1])  # fmt: skip
    trainer.train_step(X[:8], Y[:8])
    # one tower: the same seed, the same mask, the same kernels on the same batch
    for a, b in zip(trainer.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)
