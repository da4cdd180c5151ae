"""A run-time error inside one tower's shard: the step raises, and nothing changed.

A label out of range in tower 2's shard only fails when the loss op runs
(``SparseSoftmaxCrossEntropyWithLogits`` checks its labels on CPU). The step raises
TensorFlow's own ``tf.errors.InvalidArgumentError`` — towers does not wrap it: the
message names the bad label and the op, and the error is the data's, not towers' —
and because the update waits for every tower's gradients (the guard's ``tf.cond``
and ``TowerTrainer._update`` in towers/step.py), no variable was written: every replica's
weights and optimizer slots, ``iterations``, the all-reduce's error-feedback state
and the non-finite guard's counter are bitwise as before, in both placements, and
the trainer's next step is bitwise the step of a twin that never saw the bad batch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES

TOWERS = 4
X = np.linspace(-1, 1, 8 * 5, dtype="float32").reshape(8, 5)
Y = np.array([0, 1, 2, 0, 1, 2, 0, 1], "int32")


def _make() -> keras.Model:
    init = keras.initializers.GlorotUniform
    inp = keras.Input((5,))
    h = keras.layers.Dense(6, activation="relu", kernel_initializer=init(0))(inp)
    h = keras.layers.Dropout(0.2, seed=3)(h)
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer=init(1))(h))


def _trainer(variables: str) -> towers.TowerTrainer:
    return towers.TowerTrainer(
        _make, lambda: keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy",
        devices=DEVICES[:TOWERS], variables=variables,
        all_reduce=towers.compressed("ring", "topk"),
    )  # fmt: skip


def _everything(trainer: towers.TowerTrainer) -> dict[str, bytes]:
    """Every variable a step may write, on every replica, as bytes."""
    state = {}  # keyed by position: two trainers' variables have different Keras paths
    for i, replica in enumerate(trainer.replicas):
        for j, v in enumerate([*replica.model.variables, *replica.optimizer.variables]):
            state[f"replica {i} variable {j}"] = np.asarray(v.numpy()).tobytes()
    for j, v in enumerate(trainer.algorithm.variables):
        state[f"all-reduce state {j}"] = np.asarray(v.numpy()).tobytes()
    state["iterations"] = np.asarray(trainer.optimizer.iterations.numpy()).tobytes()
    state["skipped"] = np.asarray(trainer.skipped_steps).tobytes()
    return state


@pytest.mark.long
@pytest.mark.parametrize("variables", ["parameter_device", "replicated"])
def test_a_failing_tower_raises_and_changes_nothing_anywhere(variables: str) -> None:
    trainer, twin = _trainer(variables), _trainer(variables)
    for t in (trainer, twin):
        t.train_step(X, Y)  # slots and error-feedback residuals are non-zero from here
    assert any(np.any(v.numpy() != 0) for v in trainer.algorithm.variables)
    before = _everything(trainer)
    assert before == _everything(twin)

    bad = Y.copy()
    bad[5] = 7  # row 5 is in tower 2's shard (8 rows over 4 towers: 2 each)
    assert towers.split(bad, TOWERS)[2].numpy().tolist() == [1, 7]
    with pytest.raises(tf.errors.InvalidArgumentError, match="label value of 7"):
        trainer.train_step(X, bad)

    after = _everything(trainer)
    changed = [k for k in before if after[k] != before[k]]
    assert not changed, f"the failed step changed {changed}"
    for t in (trainer, twin):
        t.train_step(X[::-1], Y[::-1])
    assert _everything(trainer) == _everything(twin)
