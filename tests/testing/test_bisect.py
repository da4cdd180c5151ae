"""bisect: the first step, variable and element where two configurations part.

A known divergence (:class:`~tests.testing.test_invariance.DropsATower`, or a ring that
corrupts one element) must be found at exactly its step, variable and element; honest
algorithms and the MirroredStrategy reference must stay within the bound, with a
difference above zero somewhere so the comparison is shown to have run.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import pytest
import tensorflow as tf

from tests.testing.test_invariance import LOSS, DropsATower, batches, sgd, tiny_mlp
from towers.allreduce import ALGORITHMS, bucketed
from towers.testing import bisect
from towers.testing.compare import Config, config

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
