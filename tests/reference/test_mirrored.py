"""MirroredTrainer: TensorFlow's own split, exact loss/gradient arithmetic, coexistence, drift.

The reference is only worth testing towers against if it is itself right, so the
first tests check it against a hand computation on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from reference import MirroredTrainer, per_example_loss
from tests.conftest import DEVICES
from towers.split import shard_sizes
from towers.testing import gamma, per_tower_gradients, sgd_step_bound

SGD = keras.optimizers.SGD
MSE = keras.losses.MeanSquaredError


def dense_model(seed: int = 0, inputs: int = 3, outputs: int = 2, **kw: Any) -> Callable:
    """A factory for a one-layer Dense model with fixed initial weights."""

    def make() -> keras.Model:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(outputs, **kw)])

    return make


def mlp(seed: int = 0, width: int = 5) -> Callable:
    def make() -> keras.Model:
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(width, activation="tanh"),
                keras.layers.Dense(2),
            ]
        )

    return make


def data(batch: int, inputs: int = 3, outputs: int = 2, seed: int = 0) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, inputs)).astype(np.float32)
    y = rng.normal(size=(batch, outputs)).astype(np.float32)
    return x, y


def assert_replicas_identical(trainer: MirroredTrainer) -> None:
    copies = trainer.replica_weights()
    for replica, weights in enumerate(copies[1:], start=1):
        for v, a, b in zip(trainer.model.weights, copies[0], weights, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{v.path}: replica {replica} differs")


# --- the split is TensorFlow's ------------------------------------------------------


@pytest.mark.parametrize("batch", [10, 3])
def test_each_replica_sees_mirrored_strategys_shard(batch: int) -> None:
    seen: dict[int, int] = {}

    def loss(y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        replica = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
        seen[int(replica)] = int(y_true.shape[0])
        return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)

    trainer = MirroredTrainer(dense_model(), SGD(0.1), loss, DEVICES[:4])
    trainer.train_step(*data(batch))
    assert [seen[r] for r in range(4)] == shard_sizes(batch, 4)  # [3,3,3,1] / [1,1,1,0]


# --- the arithmetic is right ---------------------------------------------------------


def _hand_step(x: np.ndarray, y: np.ndarray, weights: list[np.ndarray], lr: float) -> Any:
    """One SGD step on DEVICES[0]: per-shard gradients summed with add_n in replica order."""
    batch = x.shape[0]
    kernel, bias = (tf.Variable(w) for w in weights)
    grads, losses, start = [], [], 0
    with tf.device(DEVICES[0]):
        for size in shard_sizes(batch, 4):
            xs, ys = x[start : start + size], y[start : start + size]
            start += size
            with tf.GradientTape() as tape:
                per_ex = tf.reduce_mean(tf.square(ys - (tf.matmul(xs, kernel) + bias)), axis=-1)
                loss = tf.reduce_sum(per_ex) / batch
            grads.append(tape.gradient(loss, [kernel, bias]))
            losses.append(loss)
        summed = [tf.add_n([g[i] for g in grads]) for i in range(2)]
        return [w - lr * g.numpy() for w, g in zip(weights, summed, strict=True)], sum(losses)


def test_one_step_equals_hand_computation() -> None:
    x, y = data(10)
    trainer = MirroredTrainer(
        dense_model(), SGD(0.1), "mse", DEVICES[:4], cross_device_ops="reduction_to_one_device"
    )
    before = trainer.get_weights()
    want_weights, want_loss = _hand_step(x, y, before, 0.1)
    loss = trainer.train_step(x, y)
    for v, got, want in zip(
        trainer.model.weights, trainer.get_weights(), want_weights, strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=v.path)
    # and in float64, the full-batch analytic gradient of mean((xW + b - y)^2) / 2 outputs
    k, b = (w.astype(np.float64) for w in before)
    err = x @ k + b - y
    np.testing.assert_allclose(trainer.get_weights()[0], k - 0.1 * x.T @ err / 10, atol=1e-6)
    np.testing.assert_allclose(trainer.get_weights()[1], b - 0.1 * err.sum(0) / 10, atol=1e-6)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(float(loss), np.mean(err**2), rtol=1e-6)


def test_loss_is_weighted_global_mean_plus_regularization() -> None:
    x, y = data(10)
    sw = np.linspace(0.0, 2.0, 10).astype(np.float32)
    reg = keras.regularizers.L2(0.1)
    trainer = MirroredTrainer(dense_model(kernel_regularizer=reg), SGD(0.1), "mse", DEVICES[:4])
    k, b = (w.astype(np.float64) for w in trainer.get_weights())
    per_ex = np.mean((x @ k + b - y) ** 2, axis=1)
    want = np.sum(sw * per_ex) / 10 + 0.1 * np.sum(k**2)
    np.testing.assert_allclose(float(trainer.train_step(x, y, sample_weight=sw)), want, rtol=1e-5)


def test_collective_agrees_with_reduction_to_one_device_within_the_summation_bound() -> None:
    """Two summation orders of the same per-replica gradients: a ring and add_n on device 0.

    Each step starts both from the same weights; plain SGD then differs by at most
    ``sgd_step_bound`` (depth n − 1 bounds any summation tree of n terms; derived in
    ``towers.testing``). The per-replica gradients that size the bound come from an
    independent path (towers' own tower step, not the strategy).
    """
    n, lr = 4, 0.1
    instance = tf.distribute.ReductionToOneDevice()
    collective, one_device = (
        MirroredTrainer(mlp(), SGD(lr), "mse", DEVICES[:n], cross_device_ops=ops)
        for ops in ("collective", instance)
    )
    assert one_device.strategy.extended._cross_device_ops is instance  # the instance is used
    for step in range(3):
        start = one_device.get_weights()
        collective.set_weights(start)
        x, y = data(10, seed=step)
        grads = per_tower_gradients(one_device.model, x, y, DEVICES[:n], loss=MSE())
        losses = [float(t.train_step(x, y)) for t in (collective, one_device)]
        # The global loss is a sum of n non-negative replica losses: two orders differ by
        # at most 2·γ_(n−1)·Σ|l_i| = 2·γ_(n−1)·loss (Higham §4.2).
        np.testing.assert_allclose(losses[0], losses[1], rtol=2 * gamma(n - 1), atol=0)
        bound = sgd_step_bound(start, grads, lr, depth=n - 1)
        for v, a, b, tol in zip(
            one_device.model.weights, collective.get_weights(), one_device.get_weights(), bound,
            strict=True,
        ):
            assert np.all(np.abs(a.astype(np.float64) - b) <= tol), f"{v.path}, step {step}"
        assert any(not np.array_equal(a, b) for a, b in zip(start, one_device.get_weights()))
    assert_replicas_identical(collective)


def test_step_is_traced_once_per_shape() -> None:
    calls = []

    def loss(y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        calls.append(1)  # Python runs only while tracing: once per replica per trace
        return keras.losses.mean_squared_error(y_true, y_pred)

    trainer = MirroredTrainer(dense_model(), SGD(0.1), loss, DEVICES[:2])
    for seed in range(3):
        trainer.train_step(*data(6, seed=seed))
    assert len(calls) == 2


# --- Keras 3 + MirroredStrategy pitfalls ------------------------------------------------


def test_tutorial_cnn_with_adam_runs() -> None:
    """The TF custom-training tutorial's pattern; fails without optimizer.build in scope."""

    def cnn() -> keras.Model:
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(4, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(10),
            ]
        )

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer = MirroredTrainer(cnn, keras.optimizers.Adam(1e-3), loss, DEVICES[:4])
    rng = np.random.default_rng(0)
    x, y = rng.random((16, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, 16)
    before = trainer.get_weights()
    losses = [float(trainer.train_step(x, y)) for _ in range(2)]
    assert all(np.isfinite(losses)) and losses[1] < losses[0]
    for v, old, new in zip(trainer.model.weights, before, trainer.get_weights(), strict=True):
        assert not np.array_equal(old, new), f"{v.path} did not change"
    assert_replicas_identical(trainer)
    assert int(trainer.optimizer.iterations.numpy()) == 2


def test_many_trainers_coexist_in_one_process() -> None:
    """Default MirroredStrategy objects would abort: "Shape mismatch in the collective
    instance 100". Unique collective group keys keep these apart."""
    x, y = data(8)
    trainers = [MirroredTrainer(mlp(width=w), SGD(0.1), "mse", DEVICES[:4]) for w in (2, 5, 7)]
    for _ in range(2):
        for trainer in trainers:
            assert np.isfinite(float(trainer.train_step(x, y)))
    for trainer in trainers:
        assert_replicas_identical(trainer)


def test_batchnorm_moving_statistics_drift_per_replica() -> None:
    def bn_model() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((1,)),
                keras.layers.BatchNormalization(momentum=0.5),
                keras.layers.Dense(1),
            ]
        )

    trainer = MirroredTrainer(bn_model, SGD(0.1), "mse", DEVICES[:4])
    x = 3 * np.arange(8, dtype=np.float32).reshape(8, 1)
    trainer.train_step(x, np.zeros((8, 1), np.float32))
    index = [v.path for v in trainer.model.weights].index(trainer.model.layers[0].moving_mean.path)
    copies = [weights[index][0] for weights in trainer.replica_weights()]
    shard_means = x.reshape(4, 2).mean(axis=1)
    np.testing.assert_allclose(copies, shard_means * 0.5, rtol=1e-6)  # not synchronized
    np.testing.assert_allclose(copies, [0.75, 3.75, 6.75, 9.75], rtol=1e-6)  # docs/architecture.md
    assert len(set(copies)) == 4
    np.testing.assert_array_equal(trainer.get_weights()[index], [copies[0]])  # replica 0's
    for v, *replicas in zip(trainer.model.weights, *trainer.replica_weights(), strict=True):
        if v.trainable:
            for copy in replicas[1:]:
                np.testing.assert_array_equal(copy, replicas[0], err_msg=v.path)


# --- weights, inputs, arguments -------------------------------------------------------


def test_set_weights_reaches_every_replica_and_ignores_tower_keywords() -> None:
    def bn_model() -> keras.Model:
        return keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])

    trainer = MirroredTrainer(
        bn_model,
        SGD(0.1),
        "mse",
        DEVICES[:3],
        all_reduce="ring",
        variables="replicated",
        semantics="one_device",
    )
    new = [np.full(w.shape, i + 1.5, np.float32) for i, w in enumerate(trainer.get_weights())]
    trainer.set_weights(new)
    for replica in trainer.replica_weights():
        for got, want in zip(replica, new, strict=True):
            np.testing.assert_array_equal(got, want)


def test_instances_are_cloned_into_the_scope() -> None:
    model = dense_model()()
    original = model.get_weights()
    optimizer = keras.optimizers.SGD(0.25, momentum=0.5)
    trainer = MirroredTrainer(model, optimizer, keras.losses.MeanSquaredError(), DEVICES[:2])
    assert trainer.model is not model and trainer.optimizer is not optimizer
    assert trainer.optimizer.get_config() == optimizer.get_config()
    for a, b in zip(trainer.get_weights(), original, strict=True):
        np.testing.assert_array_equal(a, b)
    trainer.train_step(*data(4))
    for a, b in zip(model.get_weights(), original, strict=True):
        np.testing.assert_array_equal(a, b)  # the caller's model is untouched
    assert not np.array_equal(trainer.get_weights()[0], original[0])


@pytest.mark.parametrize("structure", ["dict", "list"])
def test_structured_inputs(structure: str) -> None:
    def two_inputs() -> keras.Model:
        keras.utils.set_random_seed(0)
        a, b = keras.Input((2,), name="a"), keras.Input((1,), name="b")
        out = keras.layers.Dense(2)(keras.layers.Concatenate()([a, b]))
        return keras.Model({"a": a, "b": b} if structure == "dict" else [a, b], out)

    x, y = data(6)
    parts = {"a": x[:, :2], "b": tf.constant(x[:, 2:])}
    inputs = parts if structure == "dict" else list(parts.values())
    trainer = MirroredTrainer(two_inputs, SGD(0.1), "mse", DEVICES[:4])
    k, b = trainer.get_weights()
    want = np.mean((x @ k + b - y) ** 2)
    np.testing.assert_allclose(float(trainer.train_step(inputs, y)), want, rtol=1e-5)


def test_per_example_loss() -> None:
    y_true, y_pred = tf.zeros([4, 3]), tf.reshape(tf.range(12, dtype=tf.float32), [4, 3])
    want = np.mean(np.arange(12.0).reshape(4, 3) ** 2, axis=1)
    summing = keras.losses.MeanSquaredError(reduction="sum")  # its reduction is bypassed
    for loss in ("mse", summing, keras.losses.mean_squared_error):
        np.testing.assert_allclose(per_example_loss(loss, y_true, y_pred), want)
    pixels = per_example_loss(lambda t, p: tf.square(t - p), y_true, y_pred)  # rank 2
    np.testing.assert_allclose(pixels, want)
    with pytest.raises(ValueError, match="got a scalar"):
        per_example_loss(lambda t, p: tf.reduce_mean(p), y_true, y_pred)
    with pytest.raises(TypeError, match="loss"):
        per_example_loss(3, y_true, y_pred)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("devices", "error", "match"),
    [
        ([], ValueError, "devices must name at least one"),
        ("/device:CPU:0", TypeError, "devices must be a list"),
        (["/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"], ValueError, "dupl"),
        (["/device:CPU:0", "/device:CPU:99"], ValueError, r"devices: unknown .*CPU:99"),
    ],
)
def test_bad_devices(devices: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        MirroredTrainer(dense_model(), SGD(0.1), "mse", devices)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"cross_device_ops must be one of .*collective"):
        MirroredTrainer(dense_model(), SGD(0.1), "mse", DEVICES[:2], cross_device_ops="ring")
    with pytest.raises(ValueError, match=r"not built.*factory"):
        MirroredTrainer(keras.Sequential([keras.layers.Dense(1)]), SGD(0.1), "mse", DEVICES[:2])
    with pytest.raises(ValueError, match="no trainable variables"):
        MirroredTrainer(dense_model(trainable=False), SGD(0.1), "mse", DEVICES[:2])
    trainer = MirroredTrainer(dense_model(), SGD(0.1), lambda t, p: tf.reduce_sum(p), DEVICES[:2])
    x, y = data(4)
    with pytest.raises(ValueError, match=r"x and y .* batch size"):
        trainer.train_step(x, y[:3])
    with pytest.raises(ValueError, match=r"sample_weight must have shape \[batch\]"):
        trainer.train_step(x, y, sample_weight=np.ones((4, 1)))
    with pytest.raises(ValueError, match="got a scalar"):
        trainer.train_step(x, y)
