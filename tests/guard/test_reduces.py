"""towers.guard.reduces: a user's all-reduce must sum, checked once when the trainer is built."""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce import get
from towers.allreduce.bucketed import bucketed
from towers.allreduce.compressed import compressed
from towers.guard.reduces import unproved


def _model() -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4)(inputs)))


def _trainer(all_reduce: object, n: int = 4, **kwargs: object) -> towers.TowerTrainer:
    return towers.TowerTrainer(
        _model(), keras.optimizers.SGD(0.1), "mse", devices=DEVICES[:n],
        all_reduce=all_reduce, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def unchanged(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Keeps the contract (shape, dtype, device) but does not reduce."""
    out = []
    for v in values:
        with tf.device(v.device):
            out.append(tf.identity(v))
    return out


def averaged(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A mean where the step asked for a sum."""
    out = []
    for v in values:
        with tf.device(v.device):
            out.append(tf.add_n([tf.identity(w) for w in values]) / len(values))
    return out


def summed(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A correct user all-reduce: every tower adds all inputs itself, in tower order."""
    out = []
    for v in values:
        with tf.device(v.device):
            out.append(tf.add_n([tf.identity(w) for w in values]))
    return out


class SumReducer:
    """A correct user GradientReducer (``fn`` per variable); counts its builds."""

    def __init__(self, fn: object = summed) -> None:
        self.fn, self.built = fn, 0

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        self.built += 1

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        per_var = [self.fn([row[j] for row in grads], op="sum") for j in range(len(grads[0]))]
        return [[per_var[j][t] for j in range(len(per_var))] for t in range(len(grads))]


@pytest.mark.parametrize("algorithm", [unchanged, averaged])
def test_a_callable_that_does_not_sum_is_refused(algorithm: object) -> None:
    name = algorithm.__name__  # type: ignore[attr-defined]
    message = rf"{name}.*output 0 \(tower 0\) should be the sum of the 4 towers' inputs"
    with pytest.raises(towers.AlgorithmError, match=message + ".*check_algorithm=False") as info:
        _trainer(algorithm)
    assert info.value.algorithm == name and info.value.tower == 0


def test_a_reducer_that_does_not_sum_is_refused_and_so_is_a_wrapped_callable() -> None:
    with pytest.raises(towers.AlgorithmError, match=r"'SumReducer'.*kernel"):
        _trainer(SumReducer(unchanged))
    with pytest.raises(towers.AlgorithmError, match=r"'unchanged'"):
        _trainer(bucketed(unchanged, 1024))


def test_a_correct_callable_and_reducer_pass_and_train_like_the_registry() -> None:
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
    y = np.cos(x[:, :2])
    reducer = SumReducer()
    trainers = [_trainer(summed), _trainer(reducer), _trainer("naive", variables="replicated")]
    assert reducer.built == 1
    for trainer in trainers:
        for _ in range(2):
            trainer.train_step(x, y)
    for a, b in zip(trainers[0].get_weights(), trainers[2].get_weights()):
        np.testing.assert_array_equal(a, b)  # every tower sums in tower order, as naive
    for a, b in zip(trainers[1].get_weights(), trainers[2].get_weights()):
        np.testing.assert_array_equal(a, b)


def test_the_check_can_be_switched_off_and_one_tower_needs_no_reduction() -> None:
    assert _trainer(unchanged, check_algorithm=False).algorithm is unchanged
    assert _trainer(unchanged, n=1).algorithm is unchanged  # one tower: its input is the sum


def test_only_unproved_algorithms_are_checked() -> None:
    assert unproved(get("ring")) is None
    assert unproved(get("noop")) is get("noop")  # the ceiling: it does not sum
    assert unproved(compressed("ring", "fp16")) is None  # the library's own, lossy on purpose
    assert unproved(bucketed(summed, 64)) is summed
    assert unproved(summed) is summed
    reducer = SumReducer()
    assert unproved(reducer) is reducer


def test_a_users_registry_record_proves_nothing_and_neither_do_its_parts(monkeypatch) -> None:
    """A record a user registers is information (bytes, depth), not a proof: the trainer
    still checks the algorithm, and a library algorithm built from a user's parts
    (hierarchical's inner or outer, by callable or by registered name) is checked too."""
    from towers.allreduce import Algorithm, hierarchical
    from towers.allreduce.machinery.registry import ALGORITHMS

    for name, fn in (("user_unchanged", unchanged), ("user_summed", summed)):
        monkeypatch.setitem(ALGORITHMS, name, Algorithm(name, lambda fn=fn: fn,
                                                        summation_depth=lambda n: n - 1))
    with pytest.raises(towers.AlgorithmError, match="should be the sum"):
        _trainer("user_unchanged")
    with pytest.raises(towers.AlgorithmError, match="should be the sum"):
        _trainer(hierarchical(inner=unchanged, outer="ring", group_size=2))
    with pytest.raises(towers.AlgorithmError, match="should be the sum"):
        _trainer(hierarchical(inner="naive", outer="user_unchanged", group_size=2))
    # a correct registered one, and the library's own parts, still pass
    assert unproved(get("user_summed")) is not None
    _trainer("user_summed")
    _trainer(hierarchical(inner="user_summed", outer="ring", group_size=2))
    assert unproved(hierarchical(inner="naive", outer="ring", group_size=2)) is None


def test_the_benchmarks_noop_ceiling_is_refused_as_a_trainers_all_reduce() -> None:
    # "noop" resolves (towers bench times it as the ceiling) but does not sum: a trainer
    # built on it would train every replica on its own tower's gradient
    with pytest.raises(towers.AlgorithmError, match="all_reduce"):
        _trainer("noop")
    assert _trainer("noop", check_algorithm=False).algorithm is get("noop")  # the bench's


def reads_numpy(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A bug of its own: ``.numpy()`` on a graph tensor (AttributeError while traced)."""
    total = sum(v.numpy() for v in values)
    return [tf.identity(total) for _ in values]


def test_an_algorithm_that_fails_while_traced_is_named_as_all_reduce() -> None:
    with pytest.raises(ValueError, match=r"all_reduce: reads_numpy raised AttributeError when "
                                         r"the trainer called it"):  # fmt: skip
        _trainer(reads_numpy)
