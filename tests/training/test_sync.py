"""towers.placement and towers.guard.replicas: replica 0 reaches the others through
towers.allreduce.broadcast
(recorded sends, bitwise, any dtype); a callback's optimizer change reaches every replica's
optimizer, a wrapper's inner optimizer included (LossScaleOptimizer); replicas that drift
apart are named by the replica check within k steps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from tests.model.helpers import LOSS, assert_replicas_equal, data, network
from tests.strategies import OPTIMIZERS
from towers.allreduce import record
from towers.guard.errors import ReplicaMismatchError
from towers.guard.replicas import ReplicaCheck, checksum
from towers.testing import ModelSpec, loss_fn

X, Y = data(12)
SPEC = ModelSpec("batchnorm")


def _loss_scaled() -> towers.TowerModel:
    tm = towers.TowerModel(network(1), devices=DEVICES[:2], variables="replicated")
    tm.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), LOSS)
    return tm


def test_a_scheduled_rate_reaches_every_replicas_inner_optimizer() -> None:
    tm = _loss_scaled()
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5**epoch)
    tm.fit(X, Y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[schedule])
    assert tm.trainer is not None
    for replica in tm.trainer.replicas:  # an optimizer, not its config dict
        inner = replica.optimizer.inner_optimizer
        assert isinstance(inner, keras.optimizers.SGD)
        np.testing.assert_allclose(float(inner.learning_rate.numpy()), 0.025, rtol=1e-6)
    assert_replicas_equal(tm)


def test_a_loaded_loss_scaled_model_trains_on(tmp_path: Path) -> None:
    tm = _loss_scaled()
    tm.fit(X, Y, batch_size=4, shuffle=False, verbose=0)
    tm.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    before = loaded.get_weights()
    loaded.fit(X, Y, batch_size=4, shuffle=False, verbose=0)
    assert any(not np.array_equal(a, b) for a, b in zip(loaded.get_weights(), before))
    assert_replicas_equal(loaded)


LONG = pytest.mark.long  # each case traces two trainers twice: the long proofs run the rest
CHANGES = [  # (optimizer, attribute, new value): a variable and Python hyperparameters
    pytest.param(lambda: keras.optimizers.SGD(0.1), "learning_rate", 0.5, id="learning_rate"),
    pytest.param(lambda: keras.optimizers.SGD(0.1, momentum=0.5), "momentum", 0.9, id="momentum"),
    pytest.param(lambda: keras.optimizers.Adam(0.01), "beta_1", 0.5, id="beta_1", marks=LONG),
    pytest.param(lambda: keras.optimizers.AdamW(0.01), "weight_decay", 0.3, id="weight_decay",
                 marks=LONG),
]


@pytest.mark.parametrize("variables", [  # the placements with one replica per tower
    "replicated", pytest.param("sharded", marks=pytest.mark.long)])
@pytest.mark.parametrize("make,name,value", CHANGES)
def test_a_trainers_own_optimizer_change_reaches_every_replica(
    variables: str, make: Any, name: str, value: float
) -> None:
    """``trainer.optimizer.<hyperparameter> = v`` between steps (no TowerModel, no
    callback) trains as a trainer built with ``v`` from there on: every replica follows.
    Before, only replica 0's optimizer changed and the replicas drifted apart silently."""
    def trainer() -> towers.TowerTrainer:
        return towers.TowerTrainer(network(1), make(), LOSS, devices=DEVICES[:3],
                                   variables=variables)  # fmt: skip

    changed, fresh = trainer(), trainer()
    changed.train_step(X, Y)
    fresh.train_step(X, Y)
    setattr(changed.optimizer, name, value)
    for replica in fresh.replicas:
        setattr(replica.optimizer, name, value)
    fresh.retrace()
    changed.train_step(X, Y)
    fresh.train_step(X, Y)
    for got, want in zip(changed.replica_weights(), fresh.replica_weights(), strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    weights = changed.replica_weights()
    for other in weights[1:]:
        for a, b in zip(weights[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


class Tagged(keras.layers.Layer):
    """An int8 weight beside the float ones, as a quantized layer keeps its kernel."""

    def build(self, shape: tuple[int, ...]) -> None:
        self.tag = self.add_weight(shape=(3,), dtype="int8", initializer="zeros",
                                   trainable=False)

    def call(self, x: object) -> object:
        return x


def test_replica_0_reaches_every_replica_by_recorded_sends_in_any_dtype() -> None:
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3)(Tagged()(inputs)))
    tm = towers.TowerModel(model, devices=DEVICES[:3], variables="replicated")
    tm.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    assert tm.trainer is not None
    first, others = tm.trainer.replicas[0], tm.trainer.replicas[1:]
    rng = np.random.default_rng(0)
    weights = [np.full(w.shape, -7, "int8") if w.dtype == "int8" else
               rng.normal(size=w.shape).astype(w.dtype) for w in tm.get_weights()]
    with record() as sent:
        tm.set_weights(weights)  # Keras writes replica 0; the broadcast copies it
    copied = [*first.model.weights, *first.optimizer.variables]
    dtypes = {v.dtype for v in copied}
    assert len(dtypes) >= 3  # float32, int8, the optimizer's int64 step count
    assert len(sent.transfers) == len(dtypes) * len(others)  # one send per dtype and replica
    nbytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in copied)
    assert sum(t.nbytes or 0 for t in sent.transfers) == nbytes * len(others)
    assert {t.src for t in sent.transfers} == {first.device}
    assert {t.dst for t in sent.transfers} == {r.device for r in others}
    for replica in others:
        for got, want in zip(replica.model.get_weights(), weights, strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    assert_replicas_equal(tm)


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
