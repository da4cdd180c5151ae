"""Never silently wrong: the non-finite guard skips a poisoned step atomically.

A step whose loss, gradients or non-trainable state hold a NaN or Inf on any tower must
change nothing — no weight, optimizer slot, ``optimizer.iterations``, BatchNorm
statistic, dropout seed state or all-reduce (codec, error-feedback) state on any
replica — and the next finite step must equal, bitwise, a trainer that never saw the
bad batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES
from tests.strategies import OPTIMIZERS
from towers.allreduce.codecs import topk
from towers.testing import ModelSpec, loss_fn

pytestmark = pytest.mark.long  # a long proof: python -m pytest -m long

ALGORITHMS: dict[str, Callable[[], Any]] = {
    "naive": lambda: "naive",
    "ring": lambda: "ring",
    "bucketed": lambda: towers.bucketed("naive", 1024),
    "compressed-topk": lambda: towers.compressed("ring", topk(0.5)),  # error-feedback state
}
PLACEMENTS = ("parameter_device", "replicated")


def _trainer(
    spec: ModelSpec, n: int, algorithm: str, variables: str, **kwargs: Any
) -> towers.TowerTrainer:
    return towers.TowerTrainer(
        spec.build, OPTIMIZERS["adam"], loss_fn(), devices=DEVICES[:n],
        all_reduce=ALGORITHMS[algorithm](), variables=variables, **kwargs,
    )  # fmt: skip


def _state(trainer: towers.TowerTrainer) -> list[np.ndarray]:
    """Everything a step may change: every replica's variables and optimizer variables
    (slots, iterations), and the all-reduce's own variables (codec state)."""
    values = [
        np.array(v.numpy())
        for r in trainer.replicas
        for v in [*r.model.variables, *r.optimizer.variables]
    ]
    if isinstance(trainer.algorithm, tf.Module):
        values += [np.array(v.numpy()) for v in trainer.algorithm.variables]
    return values


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for i, (p, q) in enumerate(zip(a, b)):
        assert p.dtype == q.dtype and p.shape == q.shape, i
        assert p.tobytes() == q.tobytes(), f"state {i} differs"


def _poison(spec: ModelSpec, fault: str, row: int, value: float = np.nan) -> tuple[Any, ...]:
    """A batch of 7 whose ``row`` is bad: NaN in x, or an Inf sample weight (an Inf loss)."""
    x, y = spec.batch(7, seed=9)
    if fault == "x":
        x = x.copy()
        x[row] = value
        return x, y, None
    w = np.ones([7], "float32")
    w[row] = np.inf
    return x, y, w


@pytest.mark.parametrize("variables", PLACEMENTS)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize(
    ("fault", "row", "expected"),
    [("x", 4, {1: ["loss", "gradients", "non-trainable state"]}),
     ("weight", 6, {2: ["loss", "gradients"]})],
    ids=["nan-x-tower1", "inf-loss-tower2"],
)  # fmt: skip
def test_skip_changes_nothing_and_the_next_step_equals_never_seeing_it(
    variables: str, algorithm: str, fault: str, row: int, expected: dict[int, list[str]]
) -> None:
    spec = ModelSpec("batchnorm")  # BatchNorm: non-trainable state on every replica
    seen, never = (_trainer(spec, 3, algorithm, variables) for _ in range(2))
    for trainer in (seen, never):
        trainer.train_step(*spec.batch(7, seed=0))  # Adam's slots and the codec state move
    before = _state(seen)
    loss = seen.train_step(*_poison(spec, fault, row))
    assert not np.isfinite(float(loss))
    _assert_same(before, _state(seen))
    assert seen.skipped_steps == 1
    assert seen.last_step_nonfinite == expected
    assert int(seen.optimizer.iterations) == 1
    for trainer in (seen, never):
        trainer.train_step(*spec.batch(7, seed=1))
    assert seen.last_step_nonfinite == {}
    _assert_same(_state(seen), _state(never))


@pytest.mark.parametrize("family", ["dropout", "embedding", "regularized"])
def test_skip_keeps_seed_state_and_sparse_slots(family: str) -> None:
    # dropout: the seed generator's state must not advance; embedding: sparse gradients
    # (IndexedSlices) are checked through their values; regularized: the empty tower's
    # regularization gradients are checked too (batch of 2 over 3 towers).
    spec = ModelSpec(family)
    seen, never = (_trainer(spec, 3, "naive", "replicated") for _ in range(2))
    x, y = spec.batch(2, seed=0)
    bad_y = y.copy()
    w = np.array([1.0, np.nan], "float32")  # tower 1's only example
    before = _state(seen)
    seen.train_step(x, bad_y, w)
    _assert_same(before, _state(seen))
    assert seen.last_step_nonfinite == {1: ["loss", "gradients"]}
    for trainer in (seen, never):
        trainer.train_step(x, y)
    _assert_same(_state(seen), _state(never))


def test_raise_names_the_step_and_the_towers_and_changes_nothing() -> None:
    spec = ModelSpec("dense")
    trainer = _trainer(spec, 3, "ring", "replicated", on_nonfinite="raise")
    trainer.train_step(*spec.batch(7, seed=0))
    before = _state(trainer)
    with pytest.raises(towers.NonFiniteError, match=r"step 1: .*tower 1 .*CPU:1.*loss") as info:
        trainer.train_step(*_poison(spec, "x", 3))
    assert info.value.towers == {1: ["loss", "gradients"]}
    assert info.value.step == 1
    assert isinstance(info.value, FloatingPointError)
    _assert_same(before, _state(trainer))
    trainer.train_step(*spec.batch(7, seed=1))  # still usable
    assert int(trainer.optimizer.iterations) == 2


def test_ignore_lets_nan_reach_every_replica() -> None:
    # What the guard prevents: unguarded, one tower's NaN poisons every weight and slot.
    spec = ModelSpec("dense")
    trainer = _trainer(spec, 3, "ring", "replicated", on_nonfinite="ignore")
    trainer.train_step(*_poison(spec, "x", 0))
    assert all(np.isnan(w).all() for w in trainer.get_weights())
    assert trainer.skipped_steps == 0 and trainer.last_step_nonfinite == {}


@pytest.mark.parametrize("variables", PLACEMENTS)
def test_modes_agree_bitwise_on_finite_steps(variables: str) -> None:
    spec = ModelSpec("batchnorm")
    trainers = [
        _trainer(spec, 3, "ring", variables, on_nonfinite=m) for m in ("skip", "raise", "ignore")
    ]
    for k in range(3):
        losses = {float(t.train_step(*spec.batch(5 + k, seed=k))).hex() for t in trainers}
        assert len(losses) == 1
    _assert_same(_state(trainers[0]), _state(trainers[1]))
    _assert_same(_state(trainers[0]), _state(trainers[2]))


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="on_nonfinite must be one of skip, raise, ignore"):
        _trainer(ModelSpec("dense"), 2, "naive", "replicated", on_nonfinite="warn")


@given(
    n=st.integers(2, 4),
    tower=st.integers(0, 3),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    algorithm=st.sampled_from(list(ALGORITHMS)),
    variables=st.sampled_from(PLACEMENTS),
)
def test_any_bad_tower_in_any_placement_is_skipped(
    n: int, tower: int, value: float, algorithm: str, variables: str
) -> None:
    spec = ModelSpec("batchnorm")
    trainer = _trainer(spec, n, algorithm, variables)
    x, y = spec.batch(2 * n, seed=0)
    x[2 * min(tower, n - 1)] = value
    before = _state(trainer)
    trainer.train_step(x, y)
    _assert_same(before, _state(trainer))
    assert list(trainer.last_step_nonfinite) == [min(tower, n - 1)]
