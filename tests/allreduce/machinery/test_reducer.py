"""A user's algorithm that breaks the contract gets an error naming it, the tower and the variable.

Each broken algorithm below differs from a correct one (``naive``) in exactly one way;
the step is traced (the check runs there) and must raise
:class:`towers.guard.errors.AlgorithmError` before any variable changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES, replica_bytes
from tests.strategies import OPTIMIZERS
from towers.allreduce import naive
from towers.allreduce.machinery.registry import algorithm_name
from towers.guard.errors import AlgorithmError
from towers.testing import ModelSpec, loss_fn

SPEC = ModelSpec("dense")


def _placed(values: Sequence[tf.Tensor], make: Callable[[int, tf.Tensor], Any]) -> list[Any]:
    """``naive``'s outputs, with output ``i`` replaced by ``make(i, output)``."""
    return [make(i, out) for i, out in enumerate(naive(list(values), op="sum"))]


def wrong_device(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    def move(i: int, out: tf.Tensor) -> tf.Tensor:
        with tf.device(DEVICES[0]):  # every output on tower 0's device
            return tf.identity(out)

    return _placed(values, move)


def wrong_shape(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    def flatten(i: int, out: tf.Tensor) -> tf.Tensor:
        with tf.device(out.device):
            return tf.reshape(out, [-1]) if i == 1 else out

    return _placed(values, flatten)


def returns_none(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[Any]:
    return _placed(values, lambda i, out: None if i == 1 else out)


def too_few(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    return naive(list(values), op="sum")[:-1]


def wrong_dtype(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    def cast(i: int, out: tf.Tensor) -> tf.Tensor:
        with tf.device(out.device):
            return tf.cast(out, tf.float64) if i == 2 else out

    return _placed(values, cast)


def not_a_list(values: Sequence[tf.Tensor], *, op: str = "sum") -> Any:
    return naive(list(values), op="sum")[0]


class WrongRows:
    """A GradientReducer returning one row too few."""

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        pass

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        return [list(row) for row in grads[:-1]]


def _trainer(algorithm: Any, variables: str = "replicated") -> towers.TowerTrainer:
    return towers.TowerTrainer(
        SPEC.build, OPTIMIZERS["sgd"], loss_fn(), devices=DEVICES[:3],
        all_reduce=algorithm, variables=variables,
        check_algorithm=False,  # the trace-time contract check is what these tests exercise
    )  # fmt: skip


@pytest.mark.parametrize(
    ("algorithm", "tower", "message"),
    [
        (wrong_device, 1, r"output 1 .*device '/device:CPU:1', got .*device '/device:CPU:0'"),
        (wrong_shape, 1, r"output 1 \(tower 1\) should be shape \(5, 4\).*got shape \(20,\)"),
        (returns_none, 1, r"output 1 \(tower 1\) should be a tensor with shape .*got NoneType"),
        (too_few, None, r"its outputs should be 3 outputs \(one per tower\), got 2"),
        (wrong_dtype, 2, r"output 2 \(tower 2\) should be .*float32.*got .*float64"),
        (not_a_list, None, r"its outputs should be a list of 3 tensors, got .*Tensor"),
        (WrongRows, None, r"'WrongRows' .*every variable: its outputs should be 3 rows"),
    ],
    ids=["wrong-device", "wrong-shape", "none", "too-few", "wrong-dtype", "not-a-list", "rows"],
)
@pytest.mark.parametrize("variables", ["replicated", "parameter_device"])
def test_a_broken_algorithm_is_named_with_the_tower_and_the_variable(
    algorithm: Any, tower: int | None, message: str, variables: str
) -> None:
    if isinstance(algorithm, type):  # a reducer object serves one trainer: one per case
        algorithm = algorithm()
    trainer = _trainer(algorithm, variables)
    before = replica_bytes(trainer)
    with pytest.raises(AlgorithmError, match=message) as info:
        trainer.train_step(*SPEC.batch(6, seed=0))
    name = algorithm_name(algorithm)
    assert f"all-reduce algorithm {name!r}" in str(info.value)
    assert info.value.algorithm == name and info.value.tower == tower
    if not isinstance(algorithm, WrongRows):
        # the first dense variable's gradient is the first one reduced
        assert info.value.variable == trainer.model.trainable_variables[0].path
        assert trainer.model.trainable_variables[0].path in str(info.value)
    assert isinstance(info.value, ValueError)  # `except ValueError` keeps working
    assert replica_bytes(trainer) == before


def test_registered_and_wrapped_algorithms_keep_the_contract() -> None:
    # the check adds no op: a correct algorithm traces and steps as before
    for algorithm in ("naive", "ring", "nccl", towers.bucketed("ring", 64)):
        trainer = _trainer(algorithm)
        trainer.train_step(*SPEC.batch(6, seed=0))


def test_algorithm_names() -> None:
    assert algorithm_name(towers.allreduce.get("ring")) == "ring"
    assert algorithm_name(wrong_device) == "wrong_device"
    assert algorithm_name(WrongRows()) == "WrongRows"
