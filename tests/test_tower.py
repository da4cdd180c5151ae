"""towers.tower: the per-tower loss and gradients."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers.tower import per_example_loss, tower_step
from towers.training.losses import resolve_loss


def _values(model: keras.Model) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    return (
        [tf.convert_to_tensor(v.value) for v in model.trainable_variables],
        [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables],
    )


def test_scalar_loss_is_refused() -> None:
    with pytest.raises(ValueError, match="one value per example"):
        per_example_loss(lambda y, p: tf.reduce_mean(p), tf.zeros([3]), tf.zeros([3, 2]))


def test_keras_loss_gives_per_example_values() -> None:
    fn = resolve_loss(keras.losses.MeanSquaredError())
    values = per_example_loss(fn, tf.zeros([3, 2]), tf.ones([3, 2]))
    np.testing.assert_array_equal(values.numpy(), [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="unknown Keras loss"):
        resolve_loss("no_such_loss")
    with pytest.raises(TypeError, match="loss must be"):
        resolve_loss(3)  # type: ignore[arg-type]


def test_shares_add_up_to_the_global_mean_loss_gradient() -> None:
    """Sum of tower gradients == gradient of the mean loss over the whole batch."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    x = np.random.default_rng(0).normal(size=(5, 3)).astype("float32")
    y = np.array([0, 1, 1, 0, 1], "int32")
    loss_fn = resolve_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trainable, frozen = _values(model)
    parts = [(x[:3], y[:3], None), (x[3:], y[3:], None)]
    results = [
        tower_step(
            model,
            trainable,
            frozen,
            p,
            loss_fn=loss_fn,
            global_batch=tf.constant(5),
            num_towers=2,
            device=d,
        )
        for p, d in zip(parts, DEVICES[:2])
    ]
    with tf.GradientTape() as tape:
        tape.watch(trainable)
        out, _ = model.stateless_call(trainable, frozen, x)
        full = tf.reduce_mean(loss_fn(y, out))
    expected = tape.gradient(full, trainable)
    for a, b, e in zip(results[0].grads, results[1].grads, expected):
        np.testing.assert_allclose((a + b).numpy(), e.numpy(), rtol=2e-6, atol=1e-7)
    assert float(results[0].loss + results[1].loss) == pytest.approx(float(full), rel=1e-6)


def test_variable_without_gradient_is_named() -> None:
    inp = keras.Input((3,))
    unused = keras.layers.Dense(2, name="unused_head")
    unused(inp)
    model = keras.Model(inp, keras.layers.Dense(2)(inp))
    model._tracker.unlock()  # attach the unused layer so its weights are trainable variables
    model.extra = unused
    trainable, frozen = _values(model)
    loss_fn = resolve_loss("mse")
    with pytest.raises(ValueError, match="unused_head"):
        tower_step(
            model,
            trainable,
            frozen,
            (tf.zeros([2, 3]), tf.zeros([2, 2]), None),
            loss_fn=loss_fn,
            global_batch=tf.constant(2),
            num_towers=1,
            device=DEVICES[0],
        )
