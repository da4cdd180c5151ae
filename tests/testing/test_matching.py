"""assert_steps_match and step_cases: a user's equivalence test in a few lines."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings

from tests.conftest import DEVICES, examples
from tests.testing.test_compare import users_step
from tests.testing.test_invariance import LOSS, batches, sgd, tiny_mlp
from towers import TowerTrainer
from towers.testing import assert_steps_match, step_batches, step_cases


def trainer(n: int, all_reduce: str) -> TowerTrainer:
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
    report = assert_steps_match(trainer(n, "naive"), trainer(n, "ring"), drawn)
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
