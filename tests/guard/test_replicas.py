"""Replica agreement: a non-reducing algorithm lets replicas drift, and the check names it.

``keep_own`` gives every tower its own gradient back (``noop``: the contract's shape,
dtype and device are kept, only the sum is missing), so with ``replicated`` variables
every replica applies a different update and the copies drift apart after one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.guard.errors import ReplicaMismatchError
from towers.guard.replicas import ReplicaCheck, checksum
from towers.testing import OPTIMIZERS, ModelSpec, loss_fn

SPEC = ModelSpec("batchnorm")


def keep_own(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Every tower keeps its own gradient: no reduction at all."""
    outputs = []
    for v in values:
        with tf.device(v.device):
            outputs.append(tf.identity(v))
    return outputs


def _trainer(algorithm: Any, every: int | None, variables: str = "replicated") -> Any:
    return towers.TowerTrainer(
        SPEC.build, OPTIMIZERS["adam"], loss_fn(), devices=DEVICES[:3], all_reduce=algorithm,
        variables=variables, check_replicas_every=every,
        check_algorithm=False,  # keep_own does not sum on purpose: the drift is what is checked
    )  # fmt: skip


@pytest.mark.long
@pytest.mark.parametrize("every", [1, 3])
def test_drifting_replicas_are_named_within_k_steps(every: int) -> None:
    trainer = _trainer(keep_own, every)
    for step in range(every - 1):  # not checked yet: the drift goes unseen
        trainer.train_step(*SPEC.batch(6, seed=step))
    with pytest.raises(ReplicaMismatchError) as info:
        trainer.train_step(*SPEC.batch(6, seed=every))
    first = trainer.model.weights[0].path  # the first layer's kernel differs first
    assert info.value.variable == first and info.value.replicas == [1, 2]
    assert info.value.step == every
    message = str(info.value)
    assert f"step {every}: the replicas' copies of {first} differ" in message
    assert "replica(s) [1, 2]" in message and "'keep_own'" in message
    weights = trainer.replica_weights()
    assert not np.array_equal(weights[0][0], weights[1][0])  # the check told the truth


@pytest.mark.long
@pytest.mark.parametrize("algorithm", ["ring", "naive", "nccl"])
def test_a_reducing_algorithm_never_triggers_it(algorithm: str) -> None:
    trainer = _trainer(algorithm, 1)
    for step in range(3):
        trainer.train_step(*SPEC.batch(5 + step, seed=step))  # 5 over 3: uneven shards
    assert trainer.replica_check.steps == 3


def test_one_copy_has_nothing_to_compare() -> None:
    trainer = _trainer(keep_own, 1, variables="parameter_device")
    trainer.train_step(*SPEC.batch(6, seed=0))


def test_the_checksum_sees_bits_and_positions() -> None:
    def digest(x: Any) -> list[int]:
        return checksum(tf.constant(x)).numpy().tolist()

    assert digest([0.0, 1.0]) != digest([-0.0, 1.0])  # sign of zero
    assert digest([1.0, 2.0]) != digest([2.0, 1.0])  # swapped elements
    assert digest(np.float16([1.0])) != digest(np.float16([2.0]))
    assert digest([True, False]) != digest([False, True])
    assert digest(np.uint32([7])) == digest(np.int64([7]))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_a_bad_period_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="check_replicas_every must be None or an int >= 1"):
        ReplicaCheck(bad)
