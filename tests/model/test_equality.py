"""TowerModel.fit equals ``model.fit`` under MirroredStrategy (ReductionToOneDevice, the
``naive`` order): bitwise, with a learning-rate schedule, ``class_weight``, validation and
an uneven last batch.

The last batch (32 of a batch size of 64) is uneven but splits evenly over the 4 towers
(8 each), and every per-tower divisor is a power of two, so Keras's mean of replica means
(Σ w·l / 16 · 1/4) and the towers' global mean (Σ w·l / 64) are the same float32 numbers:
the weights must agree bitwise. (A batch whose shards differ in size weighs examples
differently under MirroredStrategy: tests/training/test_fit.py derives that bound.)
The validation loss is a mean of the same per-example losses summed in another order:
within γ_k of it for k the number of additions. ``parameter_device`` equals
CentralStorageStrategy bitwise the same way.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.applications.convnext import ConvNeXt  # the blocks, at any width

import towers
from tests.conftest import DEVICES
from tests.model.helpers import LOSS, data, network
from towers.testing.bounds import gamma

N_TOWERS = 4
X, Y = data(160, seed=3)  # 64 + 64 + 32
VAL = data(48, seed=4)
CLASS_WEIGHT = {0: 1.0, 1: 2.0, 2: 0.5}


def _optimizer() -> keras.optimizers.Optimizer:
    # the rate halves every step: each of the 3 steps runs at its own rate
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 1, 0.5))


def _fit(model: keras.Model) -> keras.callbacks.History:
    return model.fit(X, Y, batch_size=64, epochs=1, shuffle=False, verbose=0,
                     class_weight=CLASS_WEIGHT, validation_data=VAL)


def test_tower_model_fit_equals_mirrored_strategy_bitwise() -> None:
    tm = towers.TowerModel(network(1), devices=DEVICES[:N_TOWERS], all_reduce="naive",
                           variables="replicated")
    tm.compile(_optimizer(), LOSS, metrics=["accuracy"])
    strategy = tf.distribute.MirroredStrategy(
        DEVICES[:N_TOWERS], cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        reference = network(1)
        reference.compile(_optimizer(), LOSS, metrics=["accuracy"])
    ours, theirs = _fit(tm), _fit(reference)
    for got, want in zip(tm.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert ours.history["val_accuracy"] == theirs.history["val_accuracy"]
    assert ours.history["accuracy"] == theirs.history["accuracy"]
    # losses: the same per-example float32 losses, summed in another order (≤ 64 + 2 terms
    # per batch, then Keras's Mean over batches): γ_70 relative
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(ours.history[key], theirs.history[key], rtol=gamma(70))
    assert ours.history["loss"][0] > 0


@pytest.mark.long  # 13 s
def test_parameter_device_fit_equals_central_storage_strategy_bitwise() -> None:
    """``variables="parameter_device"`` is CentralStorageStrategy's layout: the weights and
    the validation figures agree bitwise. (The reference's *training* loss and accuracy are
    not the example-weighted means — 0.3529 is no k/160 — so they are not compared; under
    MirroredStrategy, above, ours equal Keras's.)"""
    tm = towers.TowerModel(network(1), devices=DEVICES[:N_TOWERS], variables="parameter_device")
    tm.compile(_optimizer(), LOSS, metrics=["accuracy"])
    strategy = tf.distribute.experimental.CentralStorageStrategy(
        DEVICES[:N_TOWERS], parameter_device=DEVICES[0])
    with strategy.scope():
        reference = network(1)
        reference.compile(_optimizer(), LOSS, metrics=["accuracy"])
    ours, theirs = _fit(tm), _fit(reference)
    for got, want in zip(tm.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert ours.history["val_accuracy"] == theirs.history["val_accuracy"]
    np.testing.assert_allclose(ours.history["val_loss"], theirs.history["val_loss"],
                               rtol=gamma(70))  # fmt: skip


@pytest.mark.long
def test_a_keras_application_fits_bitwise_as_under_mirrored_strategy() -> None:
    """keras.applications.MobileNetV3Small, as a user builds it (rescaling, hard_swish,
    squeeze-excite, BatchNorm, dropout): one SGD step of ``fit`` on 2 towers equals
    ``model.fit`` under MirroredStrategy bitwise in every weight. Its hard_swish gradients
    depend on the ops' names (``replica_scope``): with the towers' ops under
    ``tower_<i>`` scopes this test failed (with Adam, 10 of a conv kernel's 432 elements
    differing; SGD shows it too, in half the time)."""

    def mobilenet() -> keras.Model:
        keras.utils.set_random_seed(1)
        return keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None,
                                                   classes=5)

    rng = np.random.default_rng(0)
    x, y = rng.uniform(0, 255, (16, 32, 32, 3)).astype(np.float32), rng.integers(0, 5, 16)
    loss = "sparse_categorical_crossentropy"
    tm = towers.TowerModel(mobilenet(), devices=DEVICES[:2], all_reduce="naive",
                           variables="replicated", semantics="mirrored")
    tm.compile(keras.optimizers.SGD(1e-2), loss)
    with tf.distribute.MirroredStrategy(
        DEVICES[:2], cross_device_ops=tf.distribute.ReductionToOneDevice()
    ).scope():
        reference = mobilenet()
        reference.compile(keras.optimizers.SGD(1e-2), loss)
    start = [w.copy() for w in reference.get_weights()]
    for model in (tm, reference):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    moved = 0
    for got, want, before in zip(tm.get_weights(), reference.get_weights(), start, strict=True):
        np.testing.assert_array_equal(got, want)
        moved += int(not np.array_equal(want, before))
    assert moved > 100  # the step trained (kernels, BatchNorm parameters and statistics)


@pytest.mark.long
def test_a_short_last_batch_is_bitwise_on_a_wide_convnext() -> None:
    """Keras traces a dataset with a short last batch with its batch dimension unknown;
    towers traces that step the same way (towers.compile.step). On ConvNeXt's wide
    blocks the static trace's constant folding ended 43 of 56 weights a few ULPs apart
    (measured before the fix, one tower, 8 examples at batch_size=32). Here: two towers,
    12 examples at batch_size=8 (8 + a short 4), one epoch, then evaluate and predict
    (whose forward passes run under Grappler's defaults, as Keras's do)."""

    def convnext() -> keras.Model:
        keras.utils.set_random_seed(1)
        return ConvNeXt(depths=[1, 1, 1, 1], projection_dims=[96, 192, 384, 768],
                        weights=None, input_shape=(32, 32, 3), classes=5, name="cnx")

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (12, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 5, 12)
    tm = towers.TowerModel(convnext(), devices=DEVICES[:2], all_reduce="naive",
                           variables="replicated", semantics="mirrored")
    tm.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
               metrics=["accuracy"])
    with tf.distribute.MirroredStrategy(
        DEVICES[:2], cross_device_ops=tf.distribute.ReductionToOneDevice()
    ).scope():
        reference = convnext()
        reference.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
                          metrics=["accuracy"])
    got, want = ({
        "history": model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history,
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, y, batch_size=8, verbose=0),
        "predict": model.predict(x, batch_size=8, verbose=0),
    } for model in (tm, reference))
    for a, b in zip(got["weights"], want["weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got["predict"], want["predict"])
    assert got["history"]["accuracy"] == want["history"]["accuracy"]
    assert got["evaluate"][1] == want["evaluate"][1]  # accuracy
    # The reported loss is the same sum rounded in another order: towers' tracker adds each
    # batch's global mean × B, MirroredStrategy's per-replica trackers add (local mean / n
    # × n) × b_r and are summed when read. Two batches, two replicas: at most 8 roundings
    # of relative size 2^-24 apart (measured: 1.7 of them on one CPU, 0 on another).
    ulps = 8 * 2.0**-24
    np.testing.assert_allclose(got["history"]["loss"], want["history"]["loss"], rtol=ulps, atol=0)
    np.testing.assert_allclose(got["evaluate"][0], want["evaluate"][0], rtol=ulps, atol=0)


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_gradient_clipping_clips_the_global_gradient_as_one_device_does() -> None:
    """clipnorm / clipvalue / global_clipnorm act on the reduced gradient, so a TowerModel
    trains as one device does. Keras 3 under MirroredStrategy clips each replica's share
    before its all-reduce (``_backend_apply_gradients`` runs first): there the reference
    itself moves away from one device, and the test shows it does."""
    x, y = data(24, seed=5)
    options = ({"clipnorm": 0.05}, {"clipvalue": 0.01}, {"global_clipnorm": 0.05})
    for clip in options:

        def fitted(model: keras.Model, clip: dict = clip) -> list[np.ndarray]:
            model.compile(keras.optimizers.SGD(0.5, **clip), LOSS)
            model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
            return model.get_weights()

        one = fitted(network(2))
        tm = fitted(towers.TowerModel(network(2), devices=DEVICES[:N_TOWERS],
                                      all_reduce="naive", variables="replicated"))
        with tf.distribute.MirroredStrategy(
            DEVICES[:N_TOWERS], cross_device_ops=tf.distribute.ReductionToOneDevice()
        ).scope():
            mirrored = fitted(network(2))
        # one device sums a batch of 12 in one kernel, towers in shards of 3 and a sum:
        # float32 roundings apart (1e-7 here); clipping per replica moves far more
        towers_gap = max(float(np.abs(a - b).max()) for a, b in zip(tm, one))
        mirrored_gap = max(float(np.abs(a - b).max()) for a, b in zip(mirrored, one))
        assert towers_gap < 1e-6, (clip, towers_gap)
        assert mirrored_gap > 1e-4, (clip, mirrored_gap)
