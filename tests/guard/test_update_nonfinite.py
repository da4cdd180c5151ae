"""The non-finite guard covers the update's result, not only its inputs.

Finite losses and gradients can still make a non-finite update: an optimizer whose
hyperparameters overflow (SGD or RMSprop with a huge learning rate on large gradients
→ Inf weights; Adam or RMSprop with ``epsilon=0`` where a gradient is zero → 0/0).
Over optimizers × overflowing hyperparameters × placements: under ``"skip"`` the step
changes nothing, bitwise (weights, slots, ``iterations``, state) and is counted; under
``"raise"`` it raises ``NonFiniteError`` naming a variable; ``"ignore"`` lets it
through. A finite step trains bitwise as an unguarded one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES, examples

PLACEMENTS = ("replicated", "parameter_device", "sharded")


def _overflowing(kind: str, scale: float) -> tuple[Callable[[], Any], float]:
    """An optimizer whose update from finite gradients is non-finite, and the input
    magnitude that makes it so (0: zero inputs, so zero gradients)."""
    if kind == "sgd":
        return lambda: keras.optimizers.SGD(scale * 1e36), 1e3
    if kind == "sgd-momentum":
        return lambda: keras.optimizers.SGD(scale * 1e36, momentum=0.9), 1e3
    if kind == "rmsprop-lr":
        return lambda: keras.optimizers.RMSprop(scale * 1e38, rho=0.999), 1.0  # ~31.6·lr
    if kind == "adam-eps0":
        return lambda: keras.optimizers.Adam(scale * 0.1, epsilon=0.0), 0.0
    if kind == "rmsprop-eps0":
        return lambda: keras.optimizers.RMSprop(scale * 0.1, epsilon=0.0), 0.0
    raise AssertionError(kind)


KINDS = ("sgd", "sgd-momentum", "rmsprop-lr", "adam-eps0", "rmsprop-eps0")


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                             keras.layers.BatchNormalization(), keras.layers.Dense(2)])


def _trainer(optimizer: Callable[[], Any], variables: str, mode: str,
             count: int = 2) -> towers.TowerTrainer:  # fmt: skip
    keras.utils.set_random_seed(0)
    return towers.TowerTrainer(_model, optimizer, "mse", devices=DEVICES[:count],
                               variables=variables, on_nonfinite=mode)  # fmt: skip


def _state(trainer: towers.TowerTrainer) -> list[bytes]:
    return [np.asarray(v.numpy()).tobytes() for r in trainer.replicas
            for v in (*r.model.variables, *r.optimizer.variables)]  # fmt: skip


def _batch(magnitude: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal([4, 3]) * magnitude).astype("float32")
    return x, np.full([4, 2], magnitude, "float32")


@settings(max_examples=examples(6), deadline=None)
@given(kind=st.sampled_from(KINDS), scale=st.sampled_from([1.0, 10.0, 1e2]),
       variables=st.sampled_from(PLACEMENTS), count=st.sampled_from([1, 2, 3, 4]))
@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_a_non_finite_update_changes_nothing_under_skip(kind: str, scale: float,
                                                        variables: str, count: int) -> None:
    """Every replica's copy is restored (the guard keeps replica 0's values only)."""
    optimizer, magnitude = _overflowing(kind, scale)
    trainer = _trainer(optimizer, variables, "skip", count)
    before = _state(trainer)
    trainer.train_step(*_batch(magnitude))
    assert _state(trainer) == before  # bitwise: weights, slots, iterations, BatchNorm
    assert trainer.skipped_steps == 1
    # the unguarded step does make it non-finite: the case is a real one
    ignored = _trainer(optimizer, variables, "ignore", count)
    ignored.train_step(*_batch(magnitude))
    assert not all(np.isfinite(w).all() for w in ignored.get_weights())


@pytest.mark.parametrize("variables", PLACEMENTS)
def test_raise_names_the_variable_and_changes_nothing(variables: str) -> None:
    optimizer, magnitude = _overflowing("sgd", 1.0)
    trainer = _trainer(optimizer, variables, "raise", 3)
    before = _state(trainer)
    with pytest.raises(towers.NonFiniteError, match=r"update of \S+") as info:
        trainer.train_step(*_batch(magnitude))
    assert info.value.variable is not None
    assert _state(trainer) == before


@pytest.mark.parametrize("variables", [pytest.param(v, marks=pytest.mark.long) if v == "sharded"
                                       else v for v in PLACEMENTS])
def test_a_finite_step_is_bitwise_the_unguarded_one(variables: str) -> None:
    optimizer = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    guarded, plain = _trainer(optimizer, variables, "skip"), _trainer(optimizer, variables,
                                                                      "ignore")  # fmt: skip
    for _ in range(2):
        guarded.train_step(*_batch(1.0))
        plain.train_step(*_batch(1.0))
    assert _state(guarded) == _state(plain)
    assert guarded.skipped_steps == 0


def test_after_a_skipped_update_the_next_good_step_trains() -> None:
    trainer = _trainer(lambda: keras.optimizers.SGD(1e36), "replicated", "skip")
    fresh = _trainer(lambda: keras.optimizers.SGD(1e36), "replicated", "skip")
    trainer.train_step(*_batch(1e3))  # rolled back
    small = _batch(1e-20)
    trainer.train_step(*small)
    fresh.train_step(*small)
    assert trainer.skipped_steps == 1
    assert [w.tobytes() for w in trainer.get_weights()] == \
        [w.tobytes() for w in fresh.get_weights()]
