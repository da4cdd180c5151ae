"""A ``GradientReducer`` object belongs to one trainer.

Every reducer object the library offers keeps per-trainer state once built (error
feedback, PowerSGD's ``Q``, a bucket layout, the towers' devices); handed to a second
trainer it would mix the two trainers' state. The second trainer refuses it at
construction, naming ``all_reduce``. A stateless function (a registry name, a user's
per-tensor all-reduce) may still be shared, and building again for the same model
(``TowerModel.compile`` twice) is allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce.bucketed import bucketed
from towers.allreduce.compressed import compressed
from towers.allreduce.machinery.base import GradientReducer
from towers.allreduce.powersgd import powersgd

# every GradientReducer object the library makes (towers/allreduce/)
REDUCERS: dict[str, Callable[[], Any]] = {
    "compressed-topk": lambda: compressed("ring", "topk(0.5)"),
    "compressed-fp16": lambda: compressed("ring", "fp16"),
    "powersgd": lambda: compressed("ring", powersgd(1)),
    "bucketed": lambda: bucketed("ring"),
}


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])


def _trainer(all_reduce: Any) -> towers.TowerTrainer:
    return towers.TowerTrainer(_model, lambda: keras.optimizers.SGD(0.1), "mse",
                               devices=DEVICES[:2], variables="replicated",
                               all_reduce=all_reduce)  # fmt: skip


def _tower_model(all_reduce: Any) -> towers.TowerModel:
    tm = towers.TowerModel(_model(), devices=DEVICES[:2], variables="replicated",
                           all_reduce=all_reduce)  # fmt: skip
    tm.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = np.ones([4, 4], "float32"), np.zeros([4, 2], "float32")
    tm.fit(x, y, batch_size=4, epochs=1, verbose=0)  # builds its trainer
    return tm


def test_every_library_reducer_is_a_gradient_reducer() -> None:
    for make in REDUCERS.values():
        assert isinstance(make(), GradientReducer)


@pytest.mark.parametrize("kind", sorted(REDUCERS))
@pytest.mark.parametrize("first", ["trainer", "tower_model"])
@pytest.mark.parametrize("second", ["trainer", "tower_model"])
def test_a_second_trainer_refuses_a_shared_reducer(kind: str, first: str, second: str) -> None:
    build = {"trainer": _trainer, "tower_model": _tower_model}
    reducer = REDUCERS[kind]()
    keep = build[first](reducer)
    with pytest.raises(ValueError, match=r"all_reduce: .* already serves another trainer.*"
                                         r"Make a new one"):  # fmt: skip
        build[second](reducer)
    assert keep is not None


@pytest.mark.parametrize("kind", sorted(REDUCERS))
def test_one_reducer_per_trainer_trains_each_alone(kind: str) -> None:
    a, b = _trainer(REDUCERS[kind]()), _trainer(REDUCERS[kind]())
    x, y = np.ones([4, 4], "float32"), np.zeros([4, 2], "float32")
    for t in (a, b):
        t.train_step(x, y)
    assert all(np.isfinite(w).all() for w in a.get_weights() + b.get_weights())


def _user_sum(values: Any, *, op: str = "sum") -> list[tf.Tensor]:
    out = []
    for v in values:
        with tf.device(v.device):
            out.append(tf.identity(tf.add_n([tf.identity(u) for u in values])))
    return out


@pytest.mark.parametrize("algorithm", ["ring", "naive", _user_sum])
def test_a_stateless_algorithm_may_be_shared(algorithm: Any) -> None:
    first, second = _trainer(algorithm), _trainer(algorithm)
    x, y = np.ones([4, 4], "float32"), np.zeros([4, 2], "float32")
    first.train_step(x, y)
    second.train_step(x, y)


def test_the_owner_may_build_its_reducer_again() -> None:
    tm = _tower_model(REDUCERS["compressed-topk"]())
    tm.compile(keras.optimizers.SGD(0.1), "mse")  # the same model, its trainer rebuilt
    tm.fit(np.ones([4, 4], "float32"), np.zeros([4, 2], "float32"), batch_size=4, verbose=0)


def test_a_dead_trainer_frees_its_reducer() -> None:
    import gc

    reducer = REDUCERS["bucketed"]()
    _trainer(reducer)
    gc.collect()
    _trainer(reducer)  # the first trainer's variables are gone: nothing to mix
