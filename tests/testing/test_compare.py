"""compare, bisect and assert_steps_match over any two steps or configurations.

The steps are towers trainers, the MirroredStrategy reference and a user's own
single-device step function through ``as_step``. A known divergence (a tower dropped, a
ring that corrupts one element, a planted weighting bug) must be found at exactly its
step, variable and element with both values; honest steps must stay within the named
bound with a difference above zero somewhere (the comparison ran).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings

from reference import CentralStorageTrainer, MirroredTrainer
from tests.conftest import DEVICES, examples
from tests.testing.test_invariance import LOSS, DropsATower, batches, sgd, tiny_mlp
from towers import TowerTrainer
from towers.allreduce import ALGORITHMS, bucketed
from towers.testing import (
    Step,
    as_step,
    assert_steps_match,
    bisect,
    bounds,
    compare,
    step_batches,
    step_cases,
)
from towers.testing.compare import Config, config
from towers.testing.steps import check_step


def towers_step(n: int = 3, optimizer: Any = sgd, **options: Any) -> TowerTrainer:
    return TowerTrainer(tiny_mlp, optimizer, LOSS, devices=DEVICES[:n], all_reduce="ring",
                        variables="replicated", **options)  # fmt: skip


def users_step(weighting: float = 1.0) -> Any:
    """A user's one-device step: the loss's sum divided by ``weighting ×`` the batch (1: right)."""
    model, optimizer = tiny_mlp(), sgd()

    @tf.function
    def step(batch: Any) -> tf.Tensor:
        x, y = batch
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(y, model(x), True)
            loss = tf.reduce_sum(per_example) / (weighting * tf.cast(tf.shape(x)[0], tf.float32))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return as_step(step, model, optimizer=optimizer, loss=LOSS)


def test_trainers_and_the_adapter_are_steps() -> None:
    steps = [towers_step(2), MirroredTrainer(tiny_mlp, sgd, LOSS, DEVICES[:2]),
             CentralStorageTrainer(tiny_mlp, sgd, LOSS, DEVICES[:2]), users_step()]
    assert all(isinstance(s, Step) for s in steps)
    with pytest.raises(TypeError, match=r"b must be a step .* lacks get_weights, set_weights"):
        check_step("b", type("Half", (), {"train_step": lambda self, x, y: 0})())
    with pytest.raises(TypeError, match="fn must be a step function"):
        as_step(42, tiny_mlp())  # type: ignore[arg-type]


def test_towers_against_mirrored_as_steps_within_sgd_step_bound() -> None:
    report = compare(towers_step(3), MirroredTrainer(tiny_mlp, sgd, LOSS, DEVICES[:3]),
                     batches(3))  # fmt: skip
    assert report.ok, str(report)
    assert report.kind == "compare" and report.bound.startswith("sgd_step_bound")
    assert len(report.rows) == 3 * 4 and max(r.max_diff for r in report.rows) > 0
    assert all(r.bound > 0 for r in report.rows)


def test_a_users_weighting_bug_is_named_with_its_step_variable_and_values() -> None:
    """The user's step divides by twice the batch: the update is half towers' one."""
    ours = towers_step(1)
    report = bisect(ours, users_step(weighting=2.0), batches(2), towers=1)
    first = report.first
    assert first is not None and (first.step, first.compared) == (1, "update")
    assert first.variable == ours.model.trainable_variables[first.index].path
    assert first.diff == pytest.approx(abs(first.value_a - first.value_b))
    assert first.diff > first.bound > 0 and first.bound_name.startswith("sgd_step_bound")
    text = str(report)
    assert "FIRST DIVERGENCE: step 1" in text and "bound used: sgd_step_bound" in text
    assert {r.step for r in report.rows} == {1}  # bisect stops there
    assert (report.ok, report.step, report.variable) == (False, 1, first.variable)  # DESIGN.md
    assert compare(towers_step(1), users_step(), batches(2), towers=1).ok  # the right step


def test_other_optimizers_get_a_tracked_bound_or_take_one() -> None:
    adam = lambda: keras.optimizers.Adam(1e-3)  # noqa: E731
    derived = compare(towers_step(2, adam), MirroredTrainer(tiny_mlp, adam, LOSS, DEVICES[:2]),
                      batches(2))  # fmt: skip
    mirrored = MirroredTrainer(tiny_mlp, adam, LOSS, DEVICES[:2])  # fresh slots for the rest
    assert derived.ok and derived.bound.startswith("UpdateBounds"), derived.bound
    ftrl = lambda: keras.optimizers.Ftrl(0.1)  # noqa: E731  (no derived bound)
    with pytest.raises(ValueError, match=r"bound: .*plain SGD.*got Ftrl: pass bound="):
        compare(towers_step(2, ftrl), MirroredTrainer(tiny_mlp, ftrl, LOSS, DEVICES[:2]),
                batches(1))
    report = compare(towers_step(2, adam), mirrored, batches(2), bound=1e-7)
    assert report.ok and report.bound == "tolerance 1e-07 (given as bound=)"
    tight = compare(towers_step(2, adam), mirrored, batches(2),
                    bound=lambda w, x, y: [np.zeros(a.shape) for a in w])  # fmt: skip
    assert tight.first is not None and tight.bound == "<lambda> (given as bound=)"
    with pytest.raises(ValueError, match="bound must be a tolerance >= 0"):
        compare(towers_step(2, adam), mirrored, batches(1), bound=-1.0)


class _SgdTracker:
    """A stand-in for an optimizer's tracked bound (the seam's contract, not its numbers)."""

    def __init__(self) -> None:
        self.calls = 0

    def step(self, grads: list[np.ndarray], grad_errors: list[np.ndarray]) -> list[np.ndarray]:
        self.calls += 1
        return [4 * 0.1 * e for e in grad_errors]  # lr·error, 4× slack for the roundings


def test_the_tracked_bound_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where an optimizer's tracker is known (``optimizer_tracker``), it sizes the bound."""
    tracker = _SgdTracker()
    monkeypatch.setattr(bounds, "optimizer_tracker", lambda optimizer: tracker)
    momentum = lambda: keras.optimizers.SGD(0.1, momentum=0.0 + 1e-30)  # noqa: E731
    mirrored = MirroredTrainer(tiny_mlp, momentum, LOSS, DEVICES[:2])
    report = compare(towers_step(2, momentum), mirrored, batches(2))
    assert report.ok, str(report)
    assert report.bound.startswith("_SgdTracker") and tracker.calls == 2


# -- bisect --------------------------------------------------------------------------------------

OPTIONS = {"model_fn": tiny_mlp, "optimizer_fn": sgd, "loss": LOSS}


class CorruptsOneElement:
    """``ring``, but at call ``call`` (one call per variable and step) output ``element`` of
    every tower is moved by ``1e-3``."""

    __name__ = "corrupts_one_element"

    def __init__(self, call: int, element: int) -> None:
        self.call, self.element, self.calls = call, element, 0
        self.ring = ALGORITHMS["ring"]()

    def __call__(self, values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        out = self.ring(values, op=op)
        self.calls += 1
        if self.calls - 1 != self.call:
            return out
        corrupted = []
        for o in out:
            with tf.device(o.device):
                flat = tf.reshape(o, [-1])
                bump = tf.one_hot(self.element, tf.size(flat), 1e-3, 0.0)
                corrupted.append(tf.reshape(flat + bump, tf.shape(o)))
        return corrupted


@pytest.mark.parametrize("teacher", ["naive", "ring"])
def test_a_tower_dropped_at_step_3_is_found_at_step_3_and_its_variable(teacher: str) -> None:
    report = bisect(teacher, DropsATower(3, 1), batches(5), towers=4, **OPTIONS)
    first = report.first
    assert not report.ok and first is not None
    assert (first.step, first.index) == (3, 1)
    assert first.variable == tiny_mlp().trainable_variables[1].path
    assert first.compared == "gradient" and first.cause == "reduction (drops_a_tower)"
    assert first.diff == abs(first.value_a - first.value_b) and first.diff > first.bound > 0
    assert {r.step for r in report.rows} == {1, 2, 3}  # stops at the first bad step
    assert all(r.ok for r in report.rows if r.step < 3)
    assert [r.index for r in report.rows if r.step == 3 and not r.ok] == [1]
    assert "FIRST DIVERGENCE: step 3" in str(report)


def test_one_corrupted_element_is_found_with_its_chunk() -> None:
    """Step 2 (calls 4..7), the first Dense kernel (5×6 = 30 elements), element 17: under a
    4-way pad_split that is chunk 17 // ceil(30 / 4) = 2, elements 16..23."""
    report = bisect("ring", CorruptsOneElement(call=4, element=17), batches(3), towers=4,
                    **OPTIONS)  # fmt: skip
    first = report.first
    assert first is not None
    assert (first.step, first.index, first.element) == (2, 0, 17)
    assert first.chunk == (2, 4, 16, 24)
    assert first.value_b - first.value_a == pytest.approx(1e-3, rel=1e-3)
    assert "chunk 2 of 4: elements 16..23" in str(report)


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [("ring", "towers:tree", 3), ("naive", bucketed(ALGORITHMS["halving_doubling"](), 64), 4)],
)
def test_honest_algorithms_stay_within_the_bound(a: str, b: object, n: int) -> None:
    report = bisect(a, b, batches(3), towers=n, **OPTIONS)
    assert report.ok, str(report)
    assert len(report.rows) == 3 * 4
    assert max(r.max_diff for r in report.rows) > 0  # the orders differ: the check ran
    assert "PASS" in str(report)


def test_against_mirrored_one_sgd_update_per_step_finds_the_dropped_tower() -> None:
    """MirroredStrategy teaches; steps 1–2 agree within sgd_step_bound (and differ: a ring
    against the strategy's collective), step 3 drops a tower's bias gradient."""
    report = bisect("mirrored", DropsATower(3, 1), batches(4), towers=4, **OPTIONS)
    first = report.first
    assert first is not None and (first.step, first.index, first.compared) == (3, 1, "update")
    early = [r for r in report.rows if r.step < 3]
    assert len(early) == 2 * 4 and all(r.ok and r.bound > 0 for r in early)
    assert max(r.max_diff for r in early) > 0
    assert first.diff > first.bound


def test_a_reference_needs_an_optimizer_with_a_derived_bound() -> None:
    options = {**OPTIONS, "optimizer_fn": lambda: keras.optimizers.Ftrl(0.01)}
    with pytest.raises(ValueError, match=r"optimizer_fn: .*plain SGD, for .*Adam.*got Ftrl"):
        bisect("ring", "mirrored", batches(1), towers=2, **options)


def test_configs_and_bad_arguments() -> None:
    assert config("towers:ring") == Config("ring") and config("mirrored").reference
    assert config(Config("tree", label="t")).name == "t"
    with pytest.raises(ValueError, match="expected an algorithm name after 'towers:'"):
        config("towers:mirrored")
    with pytest.raises(ValueError, match="an all-reduce or a reducer, got 42"):
        config(42)
    with pytest.raises(ValueError, match=r"towers must be an integer in 1\.\.8"):
        bisect("ring", "naive", batches(1), towers=0, **OPTIONS)
    with pytest.raises(ValueError, match="unknown"):
        bisect("ring", "no_such_algorithm", batches(1), towers=2, **OPTIONS)


# -- assert_steps_match and step_cases -----------------------------------------------------------


def _trainer(n: int, all_reduce: str) -> TowerTrainer:
    return TowerTrainer(tiny_mlp, sgd, LOSS, devices=DEVICES[:n], all_reduce=all_reduce,
                        variables="replicated")  # fmt: skip


@settings(max_examples=examples(ci=3))
@given(step_cases(features=5, classes=3, max_towers=4, steps=2, max_batch=6))
def test_two_summation_orders_match_on_drawn_towers_and_batches(case: tuple[int, Any]) -> None:
    """ring against naive: the reduction bound holds on every drawn case (empty towers too).
    Against MirroredStrategy the update bound does not cover the towers' kernel noise (a
    drawn batch of one example: 1.5e-9 on a bias over a bound of 9.7e-11), so that pair is
    checked on fixed batches (test_compare.py)."""
    n, drawn = case
    assert 1 <= n <= 4 and len(drawn) == 2
    assert all(x.shape == (len(y), 5) and 1 <= len(y) <= 6 for x, y in drawn)
    report = assert_steps_match(_trainer(n, "naive"), _trainer(n, "ring"), drawn)
    assert report.ok and report.kind == "compare" and report.bound.startswith("reduction")


def test_a_mismatch_raises_with_the_first_divergence() -> None:
    ours = TowerTrainer(tiny_mlp, sgd, LOSS, devices=DEVICES[:1], all_reduce="ring")
    with pytest.raises(AssertionError, match=r"(?s)the steps differ.*FIRST DIVERGENCE: step 1"):
        assert_steps_match(ours, users_step(weighting=3.0), batches(1), towers=1)


def test_bad_strategy_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="max_batch must be an int >= 1, got 0"):
        step_batches(5, 3, max_batch=0)
    with pytest.raises(ValueError, match="max_towers must be an int >= 1, got 0"):
        step_cases(5, 3, max_towers=0)
