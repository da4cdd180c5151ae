"""check_invariance: honest algorithms within the bound at 1, 2, 3, 4, 8 towers; a known fault
flagged at exactly its step and variable; bad arguments named.

The model is a tiny tanh MLP (5 → 6 → 3) on 12-example batches, so each check runs in about
a second. The known divergence is :class:`DropsATower`: ``naive``, except that at one step
it leaves one tower's contribution to one variable out of the sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from reference import MirroredTrainer
from tests.conftest import DEVICES
from towers import TowerTrainer
from towers.allreduce import naive
from towers.testing import check_invariance

VARIABLES = 4  # dense/kernel, dense/bias, dense_1/kernel, dense_1/bias


def tiny_mlp() -> keras.Model:
    """5 → 6 (tanh) → 3, the same weights on every call."""
    inp = keras.Input((5,))
    init = keras.initializers.GlorotUniform
    h = keras.layers.Dense(6, activation="tanh", kernel_initializer=init(1), name="dense")(inp)
    out = keras.layers.Dense(3, kernel_initializer=init(2), name="dense_1")(h)
    return keras.Model(inp, out)


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batches(steps: int, size: int = 12) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(size, 5)).astype("float32"), rng.integers(0, 3, size).astype("int32"))
        for _ in range(steps)
    ]


class DropsATower:
    """``naive``, but at call ``step`` for variable ``variable`` tower 1's value is zeroed.

    The step's reduce phase calls a per-tensor algorithm once per variable, in model order,
    so call ``c`` (counted per tower count) is step ``c // variables + 1``, variable
    ``c % variables``. One tower (nothing to drop) is left alone.
    """

    __name__ = "drops_a_tower"

    def __init__(self, step: int = 3, variable: int = 1, variables: int = VARIABLES) -> None:
        self.step, self.variable, self.variables = step, variable, variables
        self.calls: dict[int, int] = {}

    def __call__(self, values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        n = len(values)
        call = self.calls.get(n, 0)
        self.calls[n] = call + 1
        step, variable = call // self.variables + 1, call % self.variables
        if n > 1 and (step, variable) == (self.step, self.variable):
            with tf.device(values[1].device):
                dropped = tf.zeros_like(values[1])
            values = [values[0], dropped, *values[2:]]
        return naive(values, op=op)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive", "halving_doubling"])
def test_honest_algorithms_are_within_the_bound_at_1_2_3_4_8_towers(algorithm: str) -> None:
    report = check_invariance(
        tiny_mlp, sgd, LOSS, batches(1), towers=(1, 2, 3, 4, 8), all_reduce=algorithm,
        variables="replicated" if algorithm == "ring" else "parameter_device",
        trajectory=algorithm == "ring",
    )  # fmt: skip
    assert report.ok, str(report)
    assert report.first_failure is None
    assert len(report.rows) == 1 * 4 * VARIABLES  # steps × other tower counts × variables
    # The comparison ran: reordered sums really differ somewhere, and the bound is not 0.
    assert max(report.max_diff(n) for n in (2, 3, 4, 8)) > 0
    assert all(r.bound > 0 for r in report.rows)
    assert "PASS" in str(report)
    if algorithm == "ring":
        assert sorted(report.trajectory) == [2, 3, 4, 8]
        assert all(len(v) == 1 and all(np.isfinite(v)) for v in report.trajectory.values())


def test_a_tower_dropped_at_step_3_is_flagged_at_exactly_that_step_and_variable() -> None:
    report = check_invariance(
        tiny_mlp, sgd, LOSS, batches(4), towers=(1, 2, 4), all_reduce=DropsATower(3, 1),
        trajectory=False,
    )  # fmt: skip
    assert not report.ok and not report.reduction_ok
    first = report.first_failure
    assert first is not None
    assert (first.towers, first.step, first.index) == (2, 3, 1)
    assert first.variable == tiny_mlp().trainable_variables[1].path  # dense/bias
    assert first.cause == "reduction (2)"
    bad = {(r.towers, r.step, r.index) for r in report.rows if not r.ok}
    assert bad == {(2, 3, 1), (4, 3, 1)}  # nothing else: the steps before and after are fine
    assert first.worst_diff > first.bound
    assert "FAIL: 2 towers, step 3" in str(report)


def test_a_small_relative_error_in_the_reduction_is_caught() -> None:
    """Not only gross faults: a reduction off by a relative 1e-5 (about 170 ULPs) fails."""

    def slightly_off(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        out = naive(values, op=op)
        if len(values) == 1:
            return out
        scaled = []
        for o in out:
            with tf.device(o.device):
                scaled.append(o * (1 + 1e-5))
        return scaled

    report = check_invariance(
        tiny_mlp, sgd, LOSS, batches(1), towers=(1, 4), all_reduce=slightly_off, trajectory=False
    )
    assert not report.ok
    assert report.first_failure is not None and report.first_failure.cause == "reduction (4)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"towers": (0, 2)}, "towers must hold integers in 1..8"),
        ({"towers": (1, 9)}, "towers must hold integers in 1..8"),
        ({"towers": (1, 1)}, "towers must not repeat"),
        ({"towers": ()}, "towers must be a non-empty sequence"),
        ({"towers": "12"}, "towers must be a non-empty sequence"),
        ({"steps": 0}, "steps must be None or an int >= 1"),
        ({"steps": 3}, "batches: need 3"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    options = {"towers": (1, 2), **kwargs}
    with pytest.raises(ValueError, match=message):
        check_invariance(tiny_mlp, sgd, LOSS, batches(2), **options)


def test_batches_must_be_pairs() -> None:
    with pytest.raises(ValueError, match=r"batches\[0\] must be an \(x, y\) pair"):
        check_invariance(tiny_mlp, sgd, LOSS, [np.zeros((4, 5))], towers=(1, 2))
    with pytest.raises(ValueError, match="batches: need 1"):
        check_invariance(tiny_mlp, sgd, LOSS, [], towers=(1, 2))
    assert len(DEVICES) == 8  # the messages above name the 8 configured devices


class ShardSizeDependent(keras.layers.Layer):
    """Scales by ``1 + 1e-3·(rows in the call)``: an example's value depends on its shard's
    size, as a kernel that blocks by batch size (oneDNN's MatMul) does in the last bits."""

    def call(self, x: tf.Tensor) -> tf.Tensor:
        rows = keras.ops.cast(keras.ops.shape(x)[0], x.dtype)
        return x * (1.0 + 1e-3 * rows)


def shard_dependent_mlp() -> keras.Model:
    inp = keras.Input((5,))
    init = keras.initializers.GlorotUniform
    h = keras.layers.Dense(6, activation="tanh", kernel_initializer=init(1))(inp)
    out = keras.layers.Dense(3, kernel_initializer=init(2))(ShardSizeDependent()(h))
    return keras.Model(inp, out)


def test_shard_size_dependent_kernels_are_not_blamed_on_the_all_reduce() -> None:
    report = check_invariance(
        shard_dependent_mlp, sgd, LOSS, batches(1), towers=(1, 2), all_reduce="ring",
        trajectory=False,
    )  # fmt: skip
    assert not report.ok  # the runs differ beyond the bound …
    assert report.reduction_ok  # … and the all-reduce is not why
    assert {r.cause for r in report.rows if not r.ok} == {"kernels"}
    assert "note: 'kernels'" in str(report)


def _towers_factory(semantics: str) -> Any:
    return lambda model, optimizer, loss, devices: TowerTrainer(
        model, optimizer, loss, devices=devices, all_reduce="ring", variables="replicated",
        semantics=semantics)  # fmt: skip


def test_any_step_factory_is_checked_across_tower_counts() -> None:
    """``step=``: MirroredStrategy itself is invariant within the derived SGD bound; towers
    with MirroredStrategy's semantics (the tutorial's per-replica denominator) is
    not, on a batch of 10 over 4 towers
    (3+3+3+1: the last example weighs 3×), and its first failure is at step 1."""
    mirrored = check_invariance(tiny_mlp, sgd, LOSS, batches(2, size=10), towers=(1, 4),
                                step=MirroredTrainer)  # fmt: skip
    assert mirrored.ok, str(mirrored)
    assert mirrored.max_diff(4) > 0 and mirrored.trajectory == {}
    per_replica = check_invariance(tiny_mlp, sgd, LOSS, batches(1, size=10), towers=(1, 4),
                                   step=_towers_factory("mirrored"))  # fmt: skip
    bad = per_replica.first_failure
    assert bad is not None and (bad.towers, bad.step) == (4, 1)
    assert check_invariance(tiny_mlp, sgd, LOSS, batches(1, size=10), towers=(1, 4),
                            step=_towers_factory("one_device")).ok  # fmt: skip
