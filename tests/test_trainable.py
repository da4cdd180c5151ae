"""``layer.trainable`` changed after the first step is followed or refused
(towers.placement.Follower).

Plain SGD keeps no optimizer state, so a trainer that froze a layer after its first step
and a fresh trainer built with that layer frozen, started from the same weights, run
the same traced computation: they must agree bitwise. Three towers on purpose: the
mean of three equal values is not always that value, so a frozen layer stays bitwise
unchanged only because state no tower changed is kept as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES

N = 3


def _make(frozen: str | None = None) -> Callable[[], keras.Model]:
    def make() -> keras.Model:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        h = keras.layers.Dense(4, activation="tanh", name="a")(inputs)
        h = keras.layers.BatchNormalization(name="norm")(keras.layers.Dense(4, name="b")(h))
        model = keras.Model(inputs, keras.layers.Dense(2, name="c")(h))
        if frozen:
            model.get_layer(frozen).trainable = False
        return model

    return make


def _trainer(variables: str, frozen: str | None = None, **kwargs: object) -> towers.TowerTrainer:
    optimizer = kwargs.pop("optimizer", lambda: keras.optimizers.SGD(0.1))
    return towers.TowerTrainer(
        _make(frozen), optimizer, "mse", devices=DEVICES[:N],  # type: ignore[arg-type]
        all_reduce=str(kwargs.pop("all_reduce", "ring")), variables=variables,
    )  # fmt: skip


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(10, 3)).astype("f4"), rng.normal(size=(10, 2)).astype("f4")


def _layer(trainer: towers.TowerTrainer, name: str) -> list[list[np.ndarray]]:
    """Layer ``name``'s weights on every replica."""
    return [[w.numpy() for w in r.model.get_layer(name).weights] for r in trainer.replicas]


def _assert_equal(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.long
@pytest.mark.parametrize("variables", ["replicated", "parameter_device"])
def test_a_layer_frozen_after_the_first_step_stays_bitwise_and_matches_a_fresh_trainer(
    variables: str,
) -> None:
    trainer = _trainer(variables)
    trainer.train_step(*_batch(0))
    trainer.model.get_layer("b").trainable = False
    fresh = _trainer(variables, frozen="b")
    fresh.set_weights(trainer.get_weights())
    frozen, others = _layer(trainer, "b"), _layer(trainer, "c")
    traces = trainer.trace_count
    for k in range(1, 4):
        assert float(trainer.train_step(*_batch(k))) == float(fresh.train_step(*_batch(k)))
    assert trainer.trace_count == traces + 1  # retraced once, for the new trainable set
    for replica in trainer.replicas:
        assert replica.model.get_layer("b").trainable is False  # every replica followed
    for before, after in zip(frozen, _layer(trainer, "b"), strict=True):
        _assert_equal(before, after)
    assert all(not np.array_equal(x, y) for x, y in zip(others[0], _layer(trainer, "c")[0]))
    _assert_equal(trainer.get_weights(), fresh.get_weights())
    for replica in trainer.replica_weights()[1:]:
        _assert_equal(trainer.replica_weights()[0], replica)


@pytest.mark.long
def test_an_optimizer_with_slots_keeps_them_for_the_layers_still_trained() -> None:
    """Keras 3 optimizers map slots by variable: Adam, built for every layer, serves a subset."""
    trainer = _trainer("replicated", optimizer=lambda: keras.optimizers.Adam(0.01))
    trainer.train_step(*_batch(0))
    trainer.model.get_layer("b").trainable = False
    frozen = _layer(trainer, "b")
    for k in range(1, 3):
        trainer.train_step(*_batch(k))
    for before, after in zip(frozen, _layer(trainer, "b"), strict=True):
        _assert_equal(before, after)
    for replica in trainer.replica_weights()[1:]:
        _assert_equal(trainer.replica_weights()[0], replica)
    assert int(trainer.optimizer.iterations) == 3


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_unfreezing_is_followed_too() -> None:
    trainer = _trainer("replicated")
    trainer.train_step(*_batch(0))
    trainer.model.get_layer("b").trainable = False
    frozen = _layer(trainer, "b")
    trainer.train_step(*_batch(1))
    for before, after in zip(frozen, _layer(trainer, "b"), strict=True):
        _assert_equal(before, after)
    trainer.model.get_layer("b").trainable = True
    fresh = _trainer("replicated")
    fresh.set_weights(trainer.get_weights())
    before = _layer(trainer, "b")
    for k in range(2, 4):
        assert float(trainer.train_step(*_batch(k))) == float(fresh.train_step(*_batch(k)))
    assert all(not np.array_equal(x, y) for x, y in zip(before[1], _layer(trainer, "b")[1]))
    _assert_equal(trainer.get_weights(), fresh.get_weights())
    for replica in trainer.replica_weights()[1:]:
        _assert_equal(trainer.replica_weights()[0], replica)


def test_sharded_refuses_a_change_and_changes_nothing() -> None:
    trainer = _trainer("sharded")
    trainer.train_step(*_batch(0))
    weights = trainer.get_weights()
    trainer.model.get_layer("b").trainable = False
    with pytest.raises(ValueError, match=r"variables='sharded' cannot follow a change of "
                       r"trainable.*variables='replicated'"):  # fmt: skip
        trainer.train_step(*_batch(1))
    _assert_equal(weights, trainer.get_weights())


def test_a_layer_frozen_when_the_trainer_was_built_cannot_be_unfrozen() -> None:
    trainer = _trainer("replicated", frozen="b")
    trainer.train_step(*_batch(0))
    weights = trainer.get_weights()
    trainer.model.get_layer("b").trainable = True
    with pytest.raises(ValueError, match=r"trainable: b/kernel, b/bias became trainable but "
                       r"was not trainable when the trainer was built"):  # fmt: skip
        trainer.train_step(*_batch(1))
    _assert_equal(weights, trainer.get_weights())
    trainer.model.get_layer("b").trainable = False  # back as built: trains again
    trainer.train_step(*_batch(1))


def test_freezing_everything_is_refused_with_a_reason() -> None:
    trainer = _trainer("parameter_device")
    trainer.train_step(*_batch(0))
    trainer.model.trainable = False
    with pytest.raises(ValueError, match=r"trainable: every variable of the model is frozen"):
        trainer.train_step(*_batch(1))
    trainer.model.trainable = True  # as built: trains again
    trainer.train_step(*_batch(1))
