"""compare / bisect over any two steps: the protocol, the adapter, the bound each uses.

The steps are towers trainers, the MirroredStrategy reference and a user's own
single-device step function through ``as_step``; a planted weighting bug must be found
at its step and variable with both values, honest steps must stay within the named
bound with a difference above zero somewhere (the comparison ran).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from reference import CentralStorageTrainer, MirroredTrainer
from tests.conftest import DEVICES
from tests.testing.test_invariance import LOSS, batches, sgd, tiny_mlp
from towers import TowerTrainer
from towers.testing import Step, as_step, bisect, bounds, compare
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
