"""TowerModel's evaluate/predict over uneven and empty towers: exact example-weighted metrics.

Moved from the removed hand-written loop's tests (towers/training/fit.py): the claims that
still matter are about the towers' inference pass under Keras's own loop.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from tests.model.helpers import LOSS, data, network
from towers.training.inference import inference

X, Y = data(99, seed=1)


@pytest.fixture(scope="module")
def four() -> towers.TowerModel:
    """Four towers: batches of 10 split 3,3,3,1; the last batch, 9, splits 3,3,3,0."""
    tm = towers.TowerModel(network(), devices=DEVICES[:4], variables="replicated",
                           all_reduce="naive")  # fmt: skip
    xent = keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")
    tm.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy", xent])
    tm.fit(X, Y, batch_size=32, shuffle=False, verbose=0)
    return tm


def test_evaluate_aggregates_exactly_over_uneven_and_empty_towers(four: towers.TowerModel) -> None:
    got = four.evaluate(X, Y, batch_size=10, verbose=0, return_dict=True)
    logits = four.predict(X, batch_size=10, verbose=0)
    per_example = LOSS.call(Y, logits).numpy().astype(np.float64)
    # Keras's loss tracker: each batch's global mean loss weighted by its size, summed
    # in float32 over 10 batches (rel 1e-6: ~10 float32 roundings of numbers of size ~1)
    assert got["loss"] == pytest.approx(per_example.mean(), rel=1e-6)
    # Accuracy is a count of correct examples divided once by their number, not a mean of
    # the towers' accuracies (the 1-example tower would weigh as much as a 3-example one).
    correct = int(np.sum(np.argmax(logits, axis=1) == Y))
    assert got["accuracy"] == np.float32(correct) / np.float32(len(Y))
    # Every Keras metric sees the towers' outputs concatenated in tower order: the same
    # result as Keras's own metric on those outputs, updated once per batch as on one device.
    xent = keras.metrics.SparseCategoricalCrossentropy(from_logits=True)
    for start in range(0, len(Y), 10):
        xent.update_state(Y[start : start + 10], logits[start : start + 10])
    assert got["xent"] == float(xent.result())


def test_predict_splits_over_towers_in_tower_order_with_one_trace(
    four: towers.TowerModel,
) -> None:
    x = X[:10]
    got = four.predict(x, batch_size=3, verbose=0)  # 3,3,3,1: shards 1,1,1,0 and 1,0,0,0
    np.testing.assert_allclose(got, four.network(x, training=False), rtol=1e-6, atol=1e-6)
    assert four.trainer is not None
    fn = inference(four.trainer).outputs
    traces = fn.experimental_get_tracing_count()
    again = four.predict(tf.data.Dataset.from_tensor_slices((x, Y[:10])).batch(3), verbose=0)
    np.testing.assert_array_equal(again, got)
    assert fn.experimental_get_tracing_count() == traces  # same shapes: no retrace
