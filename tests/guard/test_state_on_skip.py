"""A stateful reducer's state changes exactly when the step's update is applied.

Error feedback (top-k residuals, PowerSGD's error and warm-start ``Q``) computed from an
overflowed or non-finite step holds Inf/NaN. Assigned, it poisons every later step: with
a ``LossScaleOptimizer`` every later step "overflows", the scale halves for ever and
training silently stops. So the trainer assigns the reducer's new state in its apply
phase under the update's own condition (:class:`towers.allreduce.machinery.base.StatefulReducer`):

=================================  ==========================  ==========================
step                               optimizer update            reducer state
=================================  ==========================  ==========================
finite                             applied                     committed
loss-scale overflow (any mode)     skipped, scale halved       bitwise unchanged
NaN batch, on_nonfinite="skip"     skipped (counted)           bitwise unchanged
NaN batch, on_nonfinite="raise"    skipped, NonFiniteError     bitwise unchanged
NaN batch, on_nonfinite="ignore"   applied (NaN weights)       committed (NaN), as applied
=================================  ==========================  ==========================

"ignore" applies whatever comes, as tf.distribute does; the reducer's state follows the
update there too (tf.distribute has no reducer state: "applied" is the rule it implies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce import as_written, compressed
from towers.allreduce.codecs import topk
from towers.allreduce.compressed import Compressed
from towers.allreduce.machinery.base import StatefulReducer
from towers.allreduce.naive import naive
from towers.allreduce.powersgd import powersgd
from towers.guard.errors import NonFiniteError

CODECS: dict[str, Callable[[], Any]] = {"powersgd": lambda: powersgd(1), "topk": lambda: topk(0.25)}


def _model() -> keras.Model:
    """An 8→16→3 MLP: its 8×16 kernel is compressed by PowerSGD rank 1 ((8+16)·2 < 128)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))


def _trainer(codec: str, optimizer: Any, on_nonfinite: str = "skip") -> towers.TowerTrainer:
    return towers.TowerTrainer(
        _model, optimizer, "sparse_categorical_crossentropy", devices=DEVICES[:2],
        all_reduce=compressed("ring", CODECS[codec]()), variables="replicated",
        on_nonfinite=on_nonfinite,
    )  # fmt: skip


def _lso(initial_scale: float) -> keras.optimizers.LossScaleOptimizer:
    # no growth within the test: a scale that moves is a halving
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=initial_scale, dynamic_growth_steps=10_000
    )


def _batch(seed: int, poison: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(8, 8)).astype("float32"), rng.integers(0, 3, 8)
    if poison:
        x[5] = np.nan  # tower 1's shard (rows 4..7)
    return x, y


def _reducer_state(trainer: towers.TowerTrainer) -> list[bytes]:
    reducer = trainer.reducer.dense
    assert isinstance(reducer, Compressed)
    return [v.numpy().tobytes() for row in reducer.state for var in row for v in var]


def _finite(trainer: towers.TowerTrainer) -> bool:
    reducer = trainer.reducer.dense
    assert isinstance(reducer, Compressed)
    return all(np.isfinite(v.numpy()).all() for row in reducer.state for var in row for v in var)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_an_overflowed_step_leaves_reducer_state_unchanged_and_training_goes_on(
    codec: str,
) -> None:
    # 2^126 · a loss of ~6 is past float32's largest value: the first step overflows.
    trainer = _trainer(codec, _lso(2.0**126))
    opt = trainer.optimizer
    assert _reducer_state(trainer)  # the codec has state to protect
    history = []
    for step in range(10):
        before, scale, iterations = _reducer_state(trainer), float(opt.dynamic_scale), int(
            opt.iterations)  # fmt: skip
        loss = float(trainer.train_step(*_batch(step % 2)))
        applied = int(opt.iterations) == iterations + 1
        if applied:
            assert float(opt.dynamic_scale) == scale, f"step {step}: applied, scale moved"
            assert _reducer_state(trainer) != before, f"step {step}: applied, state not committed"
        else:
            assert int(opt.iterations) == iterations, f"step {step}"
            assert float(opt.dynamic_scale) == scale / 2, f"step {step}: halved once"
            assert _reducer_state(trainer) == before, f"step {step}: overflow changed the state"
        assert _finite(trainer), f"step {step}"
        history.append((applied, loss))
    assert not history[0][0], "the first step should overflow"
    # before the fix every step overflowed: the poisoned state kept the scale halving
    assert all(applied for applied, _ in history[-6:]), history
    # the same two batches alternate: each one's loss fell over the last four steps
    assert history[-2][1] < history[-6][1] and history[-1][1] < history[-5][1], history
    assert trainer.skipped_steps == 0  # an overflow is the scale's business, not the guard's


def test_an_overflow_under_ignore_leaves_reducer_state_unchanged_too() -> None:
    # on_nonfinite="ignore" removes the guard, not the loss scale: the update is not applied
    trainer = _trainer("powersgd", _lso(2.0**126), on_nonfinite="ignore")
    before = _reducer_state(trainer)
    trainer.train_step(*_batch(0))
    assert int(trainer.optimizer.iterations) == 0
    assert float(trainer.optimizer.dynamic_scale) == 2.0**125
    assert _reducer_state(trainer) == before


@pytest.mark.parametrize("mode", ["skip", "raise"])
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_skipped_nan_step_leaves_reducer_state_unchanged(codec: str, mode: str) -> None:
    trainer = _trainer(codec, keras.optimizers.SGD(0.1), on_nonfinite=mode)
    trainer.train_step(*_batch(0))  # a finite step: the error feedback is not zero
    before, weights = _reducer_state(trainer), trainer.get_weights()
    if mode == "raise":
        with pytest.raises(NonFiniteError):
            trainer.train_step(*_batch(1, poison=True))
    else:
        trainer.train_step(*_batch(1, poison=True))
    assert trainer.skipped_steps == 1
    assert _reducer_state(trainer) == before
    assert all(a.tobytes() == b.tobytes() for a, b in zip(trainer.get_weights(), weights))
    trainer.train_step(*_batch(2))
    assert _finite(trainer) and _reducer_state(trainer) != before


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_ignore_applies_a_nan_step_and_commits_its_reducer_state(codec: str) -> None:
    # as tf.distribute: no check, the update is applied, so the reducer state is committed
    trainer = _trainer(codec, keras.optimizers.SGD(0.1), on_nonfinite="ignore")
    trainer.train_step(*_batch(0))
    before = _reducer_state(trainer)
    trainer.train_step(*_batch(1, poison=True))
    assert int(trainer.optimizer.iterations) == 2
    assert _reducer_state(trainer) != before
    assert not _finite(trainer)
    assert not all(np.isfinite(w).all() for w in trainer.get_weights())


class CountingReducer:
    """A user's stateful reducer: ``naive`` sums, and a count of the steps it reduced for."""

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        self.count = tf.Variable(0, dtype=tf.int64, trainable=False)

    def reduce_deferred(
        self, grads: Sequence[Sequence[tf.Tensor]]
    ) -> tuple[list[list[tf.Tensor]], list[tf.Tensor]]:
        columns = [naive([row[j] for row in grads], op="sum") for j in range(len(grads[0]))]
        return [list(row) for row in zip(*columns)], [self.count + 1]

    def commit(self, new_state: Sequence[tf.Tensor]) -> None:
        self.count.assign(new_state[0])

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        out, new_state = self.reduce_deferred(grads)
        self.commit(new_state)
        return out


def test_a_users_stateful_reducer_is_committed_only_on_applied_steps() -> None:
    # the contract of towers.allreduce.machinery.base.StatefulReducer, for any reducer, not only
    # codecs
    reducer = CountingReducer()
    assert isinstance(reducer, StatefulReducer)
    trainer = towers.TowerTrainer(
        _model, _lso(2.0**126), "sparse_categorical_crossentropy", devices=DEVICES[:2],
        all_reduce=reducer, variables="replicated",
    )  # fmt: skip
    for step in range(6):
        trainer.train_step(*_batch(step))
        assert int(reducer.count) == int(trainer.optimizer.iterations), f"step {step}"
    assert 0 < int(reducer.count) < 6  # some steps overflowed, later ones were applied
    trainer.train_step(*_batch(0, poison=True))  # on_nonfinite="skip"
    assert trainer.skipped_steps == 1
    assert int(reducer.count) == int(trainer.optimizer.iterations)


def test_phases_one_by_one_hand_the_reducer_state_to_apply() -> None:
    # reduce and apply in separate tf.functions: the new state travels in Reduced, and
    # apply forms the loss-scale flag itself, so overflows and commits match train_step.
    # (Eager phases round differently from the compiled step unless Grappler's remapping
    # is off, see towers.step: bitwise is asserted for compiled phases only.)
    whole, phases = (_trainer("powersgd", _lso(2.0**126)) for _ in range(2))

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        return tf.function(fn, autograph=False)

    for step in range(4):
        batch = _batch(step)
        whole.train_step(*batch)
        with as_written():
            grads = wrap(phases.forward_backward)(wrap(phases.split)(*batch))
            wrap(phases.apply)(wrap(phases.reduce)(grads))
        assert _reducer_state(phases) == _reducer_state(whole), f"step {step}"
        for a, b in zip(phases.get_weights(), whole.get_weights()):
            assert a.tobytes() == b.tobytes(), f"step {step}"
        assert float(phases.optimizer.dynamic_scale) == float(whole.optimizer.dynamic_scale)
    assert float(whole.optimizer.dynamic_scale) < 2.0**126  # an overflow was exercised
