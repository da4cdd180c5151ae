"""towers/compile/relaxed.py (and the Keras functions' choice of it): the step traced with
Keras's batch dimension."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.compile.relaxed import RelaxedBatch, relaxed_spec
from towers.split import batch_unknown, relaxes


def _spec(dataset: tf.data.Dataset) -> object:
    return iter(dataset).element_spec


def test_batch_unknown_reads_the_iterators_leading_dimension() -> None:
    x = np.zeros((10, 3), "f4")
    assert batch_unknown(_spec(tf.data.Dataset.from_tensor_slices(x).batch(4)))
    assert not batch_unknown(_spec(tf.data.Dataset.from_tensor_slices(x).batch(4, True)))
    nested = tf.data.Dataset.from_tensor_slices(({"a": x, "b": x[:, :1]}, x[:, 0])).batch(5)
    assert batch_unknown(_spec(nested))
    assert not batch_unknown(None)  # no element_spec (an iterator Keras never made)
    assert batch_unknown(tf.TensorSpec(None, tf.float32))  # unknown rank


@pytest.mark.parametrize("size,towers_,want", [
    (10, 4, True),    # 3, 3, 3, 1
    (9, 4, False),    # 3, 3, 3, 0: an empty tower keeps the static trace
    (3, 4, False),    # 1, 1, 1, 0
    (1, 1, True),
    (7, 7, True),     # 1 each
    (13, 8, False),   # 2 x 6, 1, 0
    (16, 8, True),
])  # fmt: skip
def test_relaxes_when_unknown_and_no_tower_is_empty(size: int, towers_: int, want: bool) -> None:
    x = tf.zeros([size, 2])
    assert relaxes(True, x, towers_) is want
    assert relaxes(False, x, towers_) is False


def test_relaxed_spec_frees_the_leading_dimension_only() -> None:
    spec = relaxed_spec(({"a": tf.zeros([4, 3, 2])}, tf.zeros([4], tf.int64), None))
    assert spec == ({"a": tf.TensorSpec([None, 3, 2])}, tf.TensorSpec([None], tf.int64), None)


def test_relaxed_batch_traces_once_for_every_batch_size() -> None:
    shapes = []

    def step(x: tf.Tensor) -> tf.Tensor:
        shapes.append(x.shape.as_list())
        return tf.reduce_sum(x, 0)

    relaxed = RelaxedBatch(tf.function(step, autograph=False))
    for size in (8, 5, 3):
        np.testing.assert_array_equal(relaxed(tf.ones([size, 2])), [size, size])
    assert relaxed.get_concrete_function(tf.ones([2, 2])).inputs[0].shape.as_list() == [None, 2]
    assert shapes == [[None, 2]]
    relaxed(tf.ones([4, 3]))  # another inner shape: one more (relaxed) trace
    assert shapes == [[None, 2], [None, 3]]


def _conv() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3),
                             keras.layers.Flatten(), keras.layers.Dense(3)])  # fmt: skip


@pytest.mark.long
@pytest.mark.parametrize("options", [{}, {"jit_compile": True}])
def test_fit_traces_unknown_batches_once_and_an_empty_tower_static(options: dict) -> None:
    """4 towers, 19 examples in batches of 8: 8 and 8 (2 each) share one relaxed trace; the
    last batch, 3 (1, 1, 1, 0), leaves a tower empty and takes a static trace, in which the
    empty tower does not run Conv2D (which fails on 0 rows). Every form of the step."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(19, 6, 6, 1)).astype("f4"), rng.integers(0, 3, 19)
    tm = towers.TowerModel(_conv(), devices=DEVICES[:4], variables="replicated",
                           all_reduce="naive", **options)  # fmt: skip
    tm.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    history = tm.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    assert tm.trainer is not None
    assert tm.trainer.trace_count == 2  # one relaxed, one static (3 examples), over 6 steps
    assert np.isfinite(tm.evaluate(x, y, batch_size=8, verbose=0))
    assert len(tm.trainer.compiled.relaxed._traced) == 1
    # a dataset with a fixed batch size (drop_remainder): Keras's trace is static, so is ours
    again = towers.TowerModel(_conv(), devices=DEVICES[:4], variables="replicated",
                              all_reduce="naive", **options)  # fmt: skip
    again.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    fixed = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    again.fit(fixed, epochs=2, shuffle=False, verbose=0)
    assert again.trainer is not None and again.trainer.trace_count == 1
    assert not again.trainer.compiled.relaxed._traced


def _mlp() -> keras.Model:
    keras.utils.set_random_seed(4)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(3)])  # fmt: skip


@pytest.mark.long
@pytest.mark.parametrize("n,options", [
    (1, {"variables": "parameter_device", "step_timeout": 30.0}),
    (3, {"variables": "replicated", "all_reduce": "swing", "forward_graph": "as_written"}),
    (4, {"variables": "replicated", "all_reduce": "hierarchical", "on_nonfinite": "raise"}),
    (5, {"variables": "sharded", "all_reduce": "ring", "check_replicas_every": 1}),
    (8, {"variables": "replicated", "all_reduce": "bruck", "semantics": "mirrored"}),
], ids=lambda o: "-".join(map(str, o.values())) if isinstance(o, dict) else f"n{o}")  # fmt: skip
def test_the_relaxed_trace_is_the_static_step(n: int, options: dict) -> None:
    """fit over n towers on 5n examples in batches of 2n (2n, 2n, a short n: one relaxed
    trace, no empty tower), against train_step on the same batches (static traces):
    bitwise weights and optimizer state, across tower counts, placements, algorithms,
    guards and step forms."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5 * n, 5)).astype("f4"), rng.integers(0, 3, 5 * n)
    tm = towers.TowerModel(_mlp(), devices=DEVICES[:n], **options)
    tm.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    tm.fit(x, y, batch_size=2 * n, epochs=1, shuffle=False, verbose=0)
    assert tm.trainer is not None and tm.trainer.trace_count == 1
    trainer = towers.TowerTrainer(_mlp(), keras.optimizers.Adam(0.01),
                                  "sparse_categorical_crossentropy", devices=DEVICES[:n],
                                  **options)  # fmt: skip
    for start in range(0, 5 * n, 2 * n):
        trainer.train_step(x[start:start + 2 * n], y[start:start + 2 * n])
    got = [*tm.get_weights(), *(v.numpy() for v in tm.trainer.optimizer.variables)]
    want = [*trainer.model.get_weights(), *(v.numpy() for v in trainer.optimizer.variables)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
