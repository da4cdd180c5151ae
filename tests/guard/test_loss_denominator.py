"""loss_denominator: towers reproduces the tf.distribute tutorial's loss rule, and says so.

The tutorial's ``tf.nn.compute_average_loss(per_example_loss)`` divides each replica's
sum by its shard size × replicas. On the uneven last batch (10 over 4 towers: 3+3+3+1)
``"per_replica"`` must equal the tutorial's step within the derived SGD bound, and
towers' default ``"global"`` must not (measured: 68% of the update on this batch, as
``examples/custom_loop_tutorial.py --show-global`` prints).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from examples.custom_loop_tutorial import towers_step, tutorial_batches, your_step
from tests.conftest import DEVICES
from towers.guard.loss_denominator import check_loss_denominator, tower_divisor
from towers.testing import compare


@pytest.mark.parametrize("bad", [0, -2, float("inf"), "batch", True, None],
                         ids=["zero", "negative", "inf", "name", "bool", "none"])  # fmt: skip
def test_bad_denominators_are_refused_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="loss_denominator must be 'global', 'per_replica' or"):
        check_loss_denominator(bad, "sum_over_batch_size")


def test_a_reduction_without_a_batch_divisor_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"loss_denominator='per_replica' with a loss of "
                                         r"reduction='sum' is refused"):  # fmt: skip
        check_loss_denominator("per_replica", "sum")
    assert check_loss_denominator("global", "sum") == "global"
    assert check_loss_denominator(64, "mean") == 64.0


def test_each_rule_gives_each_tower_its_divisor() -> None:
    shard = (tf.zeros([3, 2]), tf.zeros([3]), None)
    divisor = tf.constant(10)
    assert tower_divisor("global", divisor, shard, 4) is divisor
    assert int(tower_divisor("per_replica", divisor, shard, 4)) == 12
    constant = tower_divisor(64.0, divisor, shard, 4)
    assert constant.dtype == tf.int32 and int(constant) == 64  # as compute_average_loss takes it
    assert tower_divisor(2.5, divisor, shard, 4).dtype == tf.float32


def test_per_replica_equals_the_tutorial_on_an_uneven_last_batch_and_global_does_not() -> None:
    devices = DEVICES[:4]
    last = tutorial_batches(1)  # the uneven batch of 10 alone: 3+3+3+1
    ported = compare(towers_step(devices, "sgd", "per_replica"), your_step(devices, "sgd"), last)
    assert ported.ok, str(ported)
    ours, theirs = towers_step(devices, "sgd", "global"), your_step(devices, "sgd")
    report = compare(ours, theirs, last)
    first = report.first
    assert first is not None and first.diff > 10 * first.bound  # a choice, not rounding
    start = ours.get_weights()
    theirs.set_weights(start)
    ours.train_step(*last[0]), theirs.train_step(*last[0])
    moved = max(np.abs(b - s).max() for b, s in zip(theirs.get_weights(), start))
    apart = max(np.abs(a - b).max() for a, b in zip(ours.get_weights(), theirs.get_weights()))
    assert 0.3 < apart / moved < 1.0  # measured 0.684: the one-example shard weighs 3×
