"""TensorFlow's custom-training tutorial, as written, against ``TowerTrainer`` with its loss.

The tutorial ("Custom training with tf.distribute.Strategy") builds
``SparseCategoricalCrossentropy(from_logits=True, reduction="none")`` and averages the
per-example values with ``tf.nn.compute_average_loss(..., global_batch_size=B)`` inside
``strategy.run``. Handing that same loss object to ``TowerTrainer`` must train the same
step: towers divides the towers' per-example sums by the global batch too.

The strategy here adds the replicas' gradients with ``ReductionToOneDevice`` (``add_n`` on
device 0, replica order), and the trainer with ``naive`` (left to right in tower order on
one device), so the same values meet in the same order: both steps run under
:func:`~towers.allreduce.as_written` (Grappler's reordering off), and
the weights must come out bitwise equal, on an uneven batch (10 over 4: [3, 3, 3, 1]).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce import as_written

GLOBAL_BATCH = 10


def _model() -> keras.Model:
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))


def _batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    return [(rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32),
             rng.integers(0, 3, size=(GLOBAL_BATCH,)).astype(np.int64))
            for _ in range(steps)]  # fmt: skip


def _tutorial(devices: list[str], batches: list) -> list[np.ndarray]:
    """The tutorial's loop, as written there (only the cross-device ops named)."""
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model = _model()
        loss_object = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none")
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

        def compute_loss(labels, predictions):
            per_example_loss = loss_object(labels, predictions)
            return tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    dataset = tf.data.Dataset.from_tensor_slices(
        (np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])))
    dist = strategy.experimental_distribute_dataset(dataset.batch(GLOBAL_BATCH))
    for inputs in dist:
        distributed_train_step(inputs)
    return [np.array(w) for w in model.get_weights()]


@pytest.mark.parametrize("n", [1, 3, 4])
def test_the_tutorial_loss_trains_as_the_tutorial_loop(n: int) -> None:
    devices, batches = DEVICES[:n], _batches(3)
    with as_written():
        want = _tutorial(devices, batches)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        trainer = towers.TowerTrainer(_model(), keras.optimizers.SGD(0.1), loss,
                                      devices=devices, all_reduce="naive",
                                      variables="replicated")  # fmt: skip
        for x, y in batches:
            trainer.train_step(x, y)
    got = trainer.get_weights()
    start = [w.numpy() for w in _model().weights]
    assert any(np.any(g != s) for g, s in zip(got, start))  # it trained
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
