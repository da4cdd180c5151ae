"""Reference: TensorFlow's ParameterServerStrategy + ClusterCoordinator on the same data.

::

    client (chief) ── schedule(step, batch b) ──▶ whichever worker is free
    worker k:  read variables from /job:ps ─ forward/backward ─ apply_gradients on /job:ps
    coordinator.join(): every scheduled step done

The order in which the workers' updates land is the runtime's, so a run is compared
with towers' asynchronous training by the loss of the final weights on a held-out
batch, not weight for weight. Run it in a process of its own that is the cluster's
client (task ``chief`` 0, not started as a server).

References:
    https://www.tensorflow.org/tutorials/distribute/parameter_server_training
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["train_parameter_server"]


def train_parameter_server(cluster_spec: Any, make_model: Callable[[], keras.Model],
                           batches: Sequence[tuple[np.ndarray, np.ndarray]], *,
                           learning_rate: float, momentum: float = 0.0,
                           loss: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None = None,
                           ) -> list[np.ndarray]:
    """Train one pass over ``batches`` with ParameterServerStrategy and Keras SGD.

    Args:
        cluster_spec: a ``tf.train.ClusterSpec`` with ``chief`` (this client, not
            started), ``worker`` and ``ps`` jobs whose servers are running.
        make_model: a zero-argument factory returning a built Keras model.
        batches: ``(x, y)`` pairs; one scheduled step each.
        learning_rate, momentum: Keras SGD's.
        loss: ``(y_true, y_pred) -> per-example losses`` (default: mean squared error);
            their sum is divided by the step's batch size, as towers does.

    Returns:
        The final trainable weights (numpy, model order).
    """
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster_spec, task_type="chief", task_id=0, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(learning_rate, momentum=momentum)
        optimizer.build(model.trainable_variables)
    per_example_loss = loss or (lambda y, p: tf.reduce_mean(tf.square(p - y), axis=-1))

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        def replica(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                per_example = per_example_loss(y, model(x))
                mean = tf.nn.compute_average_loss(per_example,
                                                  global_batch_size=tf.shape(x)[0])
            grads = tape.gradient(mean, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return mean

        return strategy.run(replica, args=(x, y))

    for x, y in batches:
        coordinator.schedule(step, args=(tf.constant(x), tf.constant(y)))
    coordinator.join()
    return [np.asarray(v.numpy()) for v in model.trainable_variables]
