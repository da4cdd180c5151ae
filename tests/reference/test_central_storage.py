"""CentralStorageTrainer: agreement with MirroredStrategy, placement, and known failures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from reference import CentralStorageTrainer, MirroredTrainer, ReferenceUnavailable
from reference._loop import StrategyTrainer
from tests.conftest import DEVICES
from towers.devices import canonical_device

SGD = keras.optimizers.SGD
AGGREGATION_ERROR = "You must specify an aggregation method to update a AggregatingVariable"


def mlp(*extra: Callable[[], keras.layers.Layer]) -> Callable[[], keras.Model]:
    """A factory: Dense(5, tanh), then the ``extra`` layers, then Dense(2); fixed weights."""

    def make() -> keras.Model:
        keras.utils.set_random_seed(0)
        layers = [keras.Input((3,)), keras.layers.Dense(5, activation="tanh")]
        return keras.Sequential([*layers, *(f() for f in extra), keras.layers.Dense(2)])

    return make


def data(batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(batch, 3)).astype(np.float32),
        rng.normal(size=(batch, 2)).astype(np.float32),
    )


class Counter(keras.layers.Layer):
    """A stateful layer the early checks do not know: counts its calls in a variable."""

    def build(self, input_shape: Any) -> None:
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        self.calls.assign_add(1.0)
        return x


@pytest.mark.parametrize("batch", [10, 3])  # [3,3,3,1] and [1,1,1,0]: an empty shard
def test_agrees_bitwise_with_mirrored_reduction_to_one_device(batch: int) -> None:
    x, y = data(batch)
    adam = keras.optimizers.Adam(0.01)
    central = CentralStorageTrainer(mlp(), adam, "mse", DEVICES[:4])
    mirrored = MirroredTrainer(
        mlp(), adam, "mse", DEVICES[:4], cross_device_ops="reduction_to_one_device"
    )
    for _ in range(2):
        assert float(central.train_step(x, y)) == float(mirrored.train_step(x, y))
    for v, a, b in zip(
        central.model.weights, central.get_weights(), mirrored.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(a, b, err_msg=v.path)


def test_variables_live_on_the_parameter_device() -> None:
    default = CentralStorageTrainer(mlp(), SGD(0.1), "mse", DEVICES[:2])
    placed = CentralStorageTrainer(
        mlp(),
        SGD(0.1),
        "mse",
        DEVICES[:2],
        parameter_device=DEVICES[3],
        all_reduce="ring",
        variables="parameter_device",
    )
    for trainer, device in ((default, DEVICES[0]), (placed, DEVICES[3])):
        for v in trainer.model.weights:
            assert canonical_device(v.value.device) == device, v.path
    x, y = data(6)
    assert float(default.train_step(x, y)) == float(placed.train_step(x, y))
    for a, b in zip(default.get_weights(), placed.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_set_weights_round_trip() -> None:
    trainer = CentralStorageTrainer(mlp(), SGD(0.1), "mse", DEVICES[:2])
    new = [np.full(w.shape, i - 0.5, np.float32) for i, w in enumerate(trainer.get_weights())]
    trainer.set_weights(new)
    for got, want in zip(trainer.get_weights(), new, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("model", "optimizer", "cause"),
    [
        (mlp(keras.layers.BatchNormalization), SGD(0.1), "BatchNormalization"),
        (mlp(lambda: keras.layers.Dropout(0.5)), SGD(0.1), "Dropout"),
        (mlp(), keras.optimizers.Nadam(0.01), "Nadam"),
        (mlp(), SGD(0.1, use_ema=True), "use_ema"),
    ],
    ids=["batchnorm", "dropout", "nadam", "ema"],
)
def test_known_failures_are_reported_before_any_step(
    model: Callable[[], keras.Model], optimizer: keras.optimizers.Optimizer, cause: str
) -> None:
    with pytest.raises(ReferenceUnavailable, match=cause) as info:
        CentralStorageTrainer(model, optimizer, "mse", DEVICES[:2])
    assert "compare against MirroredTrainer instead" in str(info.value)


@pytest.mark.parametrize(
    ("model", "optimizer", "where"),
    [
        (mlp(keras.layers.BatchNormalization), SGD(0.1), "BatchNormalization.call"),
        (mlp(), keras.optimizers.Nadam(0.01), "nadam"),
    ],
    ids=["batchnorm", "nadam"],
)
def test_the_strategy_itself_fails_there(
    model: Callable[[], keras.Model], optimizer: keras.optimizers.Optimizer, where: str
) -> None:
    """The measured failures behind the early checks (bypassing them); if TensorFlow or
    Keras fixes one, this test says the check can go."""
    strategy = tf.distribute.experimental.CentralStorageStrategy(DEVICES[:2], DEVICES[0])
    trainer = StrategyTrainer(strategy, model, optimizer, "mse")
    with pytest.raises(ValueError, match=AGGREGATION_ERROR) as info:
        trainer.train_step(*data(4))
    assert where in str(info.value)


def test_unknown_failures_are_converted_at_the_first_step() -> None:
    trainer = CentralStorageTrainer(mlp(Counter), SGD(0.1), "mse", DEVICES[:2])
    with pytest.raises(ReferenceUnavailable, match="layer Counter") as info:
        trainer.train_step(*data(4))
    assert "compare against MirroredTrainer instead" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert AGGREGATION_ERROR in str(info.value.__cause__)


def test_mirrored_trains_what_central_storage_cannot() -> None:
    """The advice in the message works: BatchNormalization + Nadam under MirroredTrainer."""
    trainer = MirroredTrainer(
        mlp(keras.layers.BatchNormalization), keras.optimizers.Nadam(0.01), "mse", DEVICES[:2]
    )
    losses = [float(trainer.train_step(*data(8))) for _ in range(2)]
    assert all(np.isfinite(losses)) and losses[1] < losses[0]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"parameter_device: unknown .*cpu:42"):
        CentralStorageTrainer(mlp(), SGD(0.1), "mse", DEVICES[:2], parameter_device="/cpu:42")
    with pytest.raises(ValueError, match="duplicate"):
        CentralStorageTrainer(mlp(), SGD(0.1), "mse", [DEVICES[1], DEVICES[1]])
    with pytest.raises(ValueError, match="devices must name at least one"):
        CentralStorageTrainer(mlp(), SGD(0.1), "mse", [])


def test_strategies_draw_exactly_what_central_storage_can_train() -> None:
    """tests.strategies' CENTRAL_STORAGE_* lists agree with the reference's known failures,
    so the equivalence test against CentralStorageStrategy draws no case it must reject."""
    from reference.central_storage import known_failures
    from tests.strategies import CENTRAL_STORAGE_FAMILIES, CENTRAL_STORAGE_OPTIMIZERS, OPTIMIZERS
    from towers.testing import FAMILIES, ModelSpec

    sgd = SGD(0.1)
    for family in FAMILIES:
        causes = known_failures(ModelSpec(family).build(), sgd)
        assert (not causes) == (family in CENTRAL_STORAGE_FAMILIES), (family, causes)
    dense = ModelSpec("dense").build()
    for name, make in OPTIMIZERS.items():
        causes = known_failures(dense, make())
        assert (not causes) == (name in CENTRAL_STORAGE_OPTIMIZERS), (name, causes)
