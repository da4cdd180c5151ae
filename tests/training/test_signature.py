"""towers.training.signature: a checkpoint records what it holds; a restore into anything
else is refused, by name, before a single variable changes (issue 18)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce.codecs import topk
from towers.training import checkpoint, signature

X, Y = np.arange(48, dtype="float32").reshape(12, 4) / 48, np.arange(12) % 3


def _dense() -> keras.Model:
    inp = keras.Input((4,))
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer="ones")(inp))


def _trainer(
    optimizer: Callable[[], Any] = lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    model: Callable[[], keras.Model] = _dense, towers_: int = 2, **kwargs: Any,
) -> towers.TowerTrainer:  # fmt: skip
    kwargs = {"variables": "replicated", "all_reduce": "naive", **kwargs}
    trainer = towers.TowerTrainer(model, optimizer, "sparse_categorical_crossentropy",
                                  devices=DEVICES[:towers_], **kwargs)  # fmt: skip
    trainer.train_step(X, Y)
    return trainer


def _state(trainer: towers.TowerTrainer) -> list[bytes]:
    """Every value a restore could write: each replica's variables and slots, the codec's."""
    found = [v for r in trainer.replicas for v in [*r.model.variables, *r.optimizer.variables]]
    if isinstance(trainer.algorithm, tf.Module):
        found += list(trainer.algorithm.variables)
    return [np.asarray(v.numpy()).tobytes() for v in found]


def _refused(prefix: str, target: towers.TowerTrainer, message: str) -> None:
    """``restore`` raises a CheckpointError whose message is ``message`` exactly, and the
    target trainer holds, byte for byte, what it held before."""
    before = _state(target)
    with pytest.raises(towers.CheckpointError) as info:
        checkpoint.restore(target, prefix)
    assert str(info.value) == f"checkpoint {prefix!r}: does not match this trainer: {message}"
    assert _state(target) == before


@pytest.fixture
def sgd_momentum(tmp_path: Path) -> str:
    """A checkpoint of SGD(0.1, momentum=0.9) on 2 replicated towers."""
    return checkpoint.save(_trainer(), str(tmp_path / "sgd"))


def test_sgd_momentum_into_rmsprop_is_refused_by_name(sgd_momentum: str) -> None:
    """Restored by position, the momentum slot became RMSprop's mean square (issue 18)."""
    target = _trainer(lambda: keras.optimizers.RMSprop(0.1))
    _refused(sgd_momentum, target,
             "checkpoint holds optimizer SGD (learning_rate=0.1, momentum=0.9), trainer has "
             "RMSprop (learning_rate=0.1): restore into a trainer built with the same "
             "optimizer class")  # fmt: skip
    assert np.isfinite(float(target.train_step(X, Y)))


def _ln_model() -> keras.Model:
    """Same variable shapes as :func:`_dense` plus one, in another role: Dense(3)'s bias
    [3] vs LayerNormalization's gamma [3]."""
    inp = keras.Input((4,))
    h = keras.layers.Dense(3, use_bias=False, kernel_initializer="ones")(inp)
    return keras.Model(inp, keras.layers.LayerNormalization(center=False)(h))


MISMATCHES: dict[str, tuple[Callable[[], towers.TowerTrainer], str]] = {
    "hyperparameter": (
        lambda: _trainer(lambda: keras.optimizers.SGD(0.1, momentum=0.5)),
        "checkpoint holds optimizer SGD (learning_rate=0.1, momentum=0.9), trainer has SGD "
        "(learning_rate=0.1, momentum=0.5) (momentum=0.9 in the checkpoint, 0.5 here): build "
        "the trainer's optimizer with the checkpoint's hyperparameters",
    ),
    "loss-scale": (
        lambda: _trainer(lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9))),
        "checkpoint holds optimizer SGD (learning_rate=0.1, momentum=0.9), trainer has "
        "LossScaleOptimizer of SGD (learning_rate=0.1, momentum=0.9): restore into a trainer "
        "built with the same optimizer class",
    ),
    "placement": (
        lambda: _trainer(variables="parameter_device"),
        "checkpoint holds variables='replicated', trainer has variables='parameter_device': "
        "restore into a trainer built with the same placement",
    ),
    "towers": (
        lambda: _trainer(towers_=3),
        "checkpoint holds 2 replicas (variables='replicated' over 2 towers), trainer has 3 "
        "(3 towers): restore into a trainer with 2 towers (a checkpoint is not re-sharded)",
    ),
    "model-role": (
        lambda: _trainer(model=_ln_model),
        "model variable 1: dense/bias float32[3] in the checkpoint, layer_normalization/gamma "
        "float32[3] here: restore into a trainer built with the same model",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_each_mismatch_is_refused_by_name_and_changes_nothing(
    sgd_momentum: str, case: str
) -> None:
    make, message = MISMATCHES[case]
    _refused(sgd_momentum, make(), message)


def test_sharded_slots_restore_into_the_same_number_of_towers_only(tmp_path: Path) -> None:
    """Under ``sharded`` each replica holds its own shard of the slots."""
    adam = lambda: keras.optimizers.Adam(0.1)  # noqa: E731
    prefix = checkpoint.save(_trainer(adam, towers_=2, variables="sharded", all_reduce="ring"),
                             str(tmp_path / "c"))  # fmt: skip
    _refused(prefix, _trainer(adam, towers_=4, variables="sharded", all_reduce="ring"),
             "checkpoint holds 2 replicas (variables='sharded' over 2 towers), trainer has 4 "
             "(4 towers): restore into a trainer with 2 towers (a checkpoint is not "
             "re-sharded)")  # fmt: skip
    same = _trainer(adam, towers_=2, variables="sharded", all_reduce="ring")
    checkpoint.restore(same, prefix)  # the same layout round-trips


def _compressed(ratio: float) -> towers.TowerTrainer:
    return _trainer(lambda: keras.optimizers.Adam(0.1),
                    all_reduce=towers.compressed("ring", topk(ratio)))  # fmt: skip


def test_a_codec_with_other_settings_is_refused_though_its_state_has_the_same_shapes(
    tmp_path: Path,
) -> None:
    prefix = checkpoint.save(_compressed(0.5), str(tmp_path / "c"))
    # 4 residuals on each side (2 towers x 2 variables), of the same shapes
    _refused(prefix, _compressed(0.25),
             "checkpoint holds all-reduce compressed(ring, TopK(ratio=0.5), decode='once') (4 "
             "state values), trainer has compressed(ring, TopK(ratio=0.25), decode='once') "
             "(4): restore into a trainer built with the same all-reduce and codec")  # fmt: skip


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_what_may_differ_restores(tmp_path: Path) -> None:
    """A stateless all-reduce and a parameter_device trainer's tower count may differ."""
    source = _trainer(variables="parameter_device")
    prefix = checkpoint.save(source, str(tmp_path / "c"))
    other = _trainer(variables="parameter_device", towers_=3, all_reduce="ring")
    checkpoint.restore(other, prefix)
    assert _state(other) == _state(source)


def test_the_learning_rate_is_the_checkpoints_and_a_change_is_announced(
    sgd_momentum: str,
) -> None:
    target = _trainer(lambda: keras.optimizers.SGD(0.05, momentum=0.9))
    with pytest.warns(UserWarning, match=re.escape(
            "the learning rate is now the checkpoint's, 0.1; the trainer was built with 0.05")):
        checkpoint.restore(target, sgd_momentum)  # fmt: skip
    assert [float(r.optimizer.learning_rate) for r in target.replicas] == [np.float32(0.1)] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same rate: nothing to say
        checkpoint.restore(_trainer(), sgd_momentum)


def test_a_checkpoint_without_a_record_is_refused(tmp_path: Path) -> None:
    """What towers wrote before checkpoints carried a record (the old layout, rebuilt)."""
    source = _trainer()
    parts = {
        f"replica_{i}": tf.train.Checkpoint(
            model=[v.value for v in r.model.variables],
            optimizer=[v.value for v in r.optimizer.variables],
        )
        for i, r in enumerate(source.replicas)
    }
    prefix = tf.train.Checkpoint(**parts, step=source.optimizer.iterations.value).write(
        str(tmp_path / "old"))  # fmt: skip
    target = _trainer()
    before = _state(target)
    with pytest.raises(towers.CheckpointError, match="holds no record of the trainer"):
        checkpoint.restore(target, prefix)
    assert _state(target) == before


def test_the_record_names_every_part(tmp_path: Path) -> None:
    trainer = _trainer(lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1)))
    record = signature.record(trainer)
    assert record["placement"] == "replicated" and record["replicas"] == record["towers"] == 2
    assert record["model"][0] == ["dense/kernel", [4, 3], "float32", "trainable"]
    assert record["optimizer"]["class"] == "LossScaleOptimizer"
    assert record["optimizer"]["inner"]["class"] == "Adam"
    slots = [path for path, _, _ in record["slots"][1]]
    assert "loss_scale_optimizer/dynamic_scale" in slots and "adam/dense_kernel_velocity" in slots
    reader = tf.train.load_checkpoint(checkpoint.save(trainer, str(tmp_path / "c")))
    assert signature.mismatch(signature.record(trainer), record) is None
    assert reader.has_tensor(signature.KEY)
