"""Guides as tests: patterns from the Keras and TensorFlow guides, each run through
``towers.TowerModel`` and through its reference (plain Keras on one device, or
MirroredStrategy where the point is distribution). The code is ours, small (a few hundred
examples, tiny widths, one or two epochs); each docstring names the guide.

Tolerance (``close``), where no bitwise claim is made. One device sums a batch's B
per-example gradients in one kernel, the towers in n shards and a sum: the reduced
gradients differ by reassociation, |Δg| ≤ γ_B·Σ|g_i| ≈ B·2⁻²⁴·Σ|g_i| (≤ 4e-6 relative
for B ≤ 64). Over S ≤ 12 steps with small rates the difference is carried, not amplified
by more than a small factor, so the weights agree within ``RTOL`` = 1e-4 of the largest
weight movement (25× the one-step bound). Each test also checks that training moved the
weights, so a test whose model did not train fails.
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

pytestmark = pytest.mark.long

RTOL = 1e-4  # of the largest weight movement: see the module docstring


def towered(build: Callable[[], keras.Model], n: int = 4, **options: Any) -> towers.TowerModel:
    options.setdefault("all_reduce", "naive")
    options.setdefault("variables", "replicated")
    return towers.TowerModel(build(), devices=DEVICES[:n], **options)


def close(got: list[np.ndarray], want: list[np.ndarray], start: list[np.ndarray],
          rtol: float = RTOL) -> None:
    """``got`` within rtol × (largest movement of ``want`` from ``start``); ``want`` moved."""
    moved = max(float(np.abs(w - s).max()) for w, s in zip(want, start, strict=True))
    assert moved > 0, "the reference did not train"
    gap = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    assert gap <= rtol * moved, (gap, moved)


def both(build: Callable[[], keras.Model], compile_args: Callable[[], dict], fit: Callable,
         n: int = 4, **options: Any) -> tuple[keras.Model, keras.Model, list[np.ndarray]]:
    """Fit ``build()`` through n towers and on one device; returns (towers, one, start)."""
    one = build()
    start = [w.copy() for w in one.get_weights()]
    one.compile(**compile_args())
    tm = towered(build, n, **options)
    tm.compile(**compile_args())
    fit(tm)
    fit(one)
    return tm, one, start


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_functional_multi_input_multi_output_is_bitwise_as_mirrored() -> None:
    """The Functional API guide's ticket model (https://stat.ethz.ch/CRAN/web/packages/
    keras3/vignettes/functional_api.Rmd): two inputs, two outputs, a loss per output and
    loss_weights. Claimed (docs/keras.md): naive + replicated equals MirroredStrategy
    (ReductionToOneDevice) bitwise for a functional model; 128 = 2 × 64 over 4 towers."""

    def build() -> keras.Model:
        keras.utils.set_random_seed(1)
        title, body = keras.Input((6,), name="title"), keras.Input((10,), name="body")
        h = keras.layers.Dense(8, activation="relu")(keras.layers.concatenate([title, body]))
        priority = keras.layers.Dense(1, name="priority")(h)
        department = keras.layers.Dense(3, name="department")(h)
        return keras.Model([title, body], [priority, department])

    r = rng(1)
    x = [r.normal(size=(128, 6)).astype("f4"), r.normal(size=(128, 10)).astype("f4")]
    y = [r.normal(size=(128, 1)).astype("f4"), r.integers(0, 3, 128)]

    def args() -> dict:
        return {"optimizer": keras.optimizers.SGD(0.05),
                "loss": {"priority": "mse", "department": keras.losses.
                         SparseCategoricalCrossentropy(from_logits=True)},
                "loss_weights": {"priority": 1.0, "department": 0.5}}

    tm = towered(build)
    tm.compile(**args())
    with tf.distribute.MirroredStrategy(
            DEVICES[:4], cross_device_ops=tf.distribute.ReductionToOneDevice()).scope():
        ref = build()
        ref.compile(**args())
    start = ref.get_weights()
    for m in (tm, ref):
        m.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(tm.get_weights(), ref.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert any(not np.array_equal(a, b) for a, b in zip(ref.get_weights(), start))


def test_masking_lstm_over_padded_sequences() -> None:
    """Working with RNNs / masking and padding (https://rdrr.io/github/rstudio/keras/f/
    vignettes-src/understanding_masking_and_padding.Rmd): Embedding(mask_zero=True) → LSTM
    over post-padded sequences; padded steps must be skipped on every tower."""

    def build() -> keras.Model:
        keras.utils.set_random_seed(2)
        inputs = keras.Input((12,), dtype="int32")
        h = keras.layers.Embedding(30, 6, mask_zero=True)(inputs)
        h = keras.layers.LSTM(5)(h)
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    r = rng(2)
    lengths = r.integers(3, 13, 192)
    x = np.zeros((192, 12), "i4")
    for i, k in enumerate(lengths):
        x[i, :k] = r.integers(1, 30, k)
    y = (lengths / 12.0).astype("f4")
    tm, one, start = both(build, lambda: {"optimizer": keras.optimizers.SGD(0.1),
                                          "loss": "mse"},
                          lambda m: m.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                                          verbose=0))
    close(tm.get_weights(), one.get_weights(), start)
    # masking is in effect: changing a padded position changes nothing
    probe = x[:8].copy()
    probe[lengths[:8] < 12, -1] = 0
    np.testing.assert_allclose(tm.predict(probe, verbose=0), one.predict(probe, verbose=0),
                               rtol=1e-5, atol=1e-6)


class BatchLosses(keras.callbacks.Callback):
    """Writing your own callbacks: record every batch's loss and each epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[float] = []
        self.epochs: list[int] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.batches.append(float((logs or {})["loss"]))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epochs.append(epoch)


def _mlp(seed: int = 3, inputs: int = 5, classes: int = 3) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        keras.utils.set_random_seed(seed)
        x = keras.Input((inputs,))
        h = keras.layers.Dense(8, activation="relu")(x)
        return keras.Model(x, keras.layers.Dense(classes)(h))
    return build


def _classes(n: int = 192, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    r = rng(seed)
    x = r.normal(size=(n, 5)).astype("f4")
    return x, (x[:, 0] > 0).astype("i4") + (x[:, 1] > 0.5).astype("i4")


SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_custom_callback_sees_the_same_batch_losses() -> None:
    """Writing your own callbacks (https://rstudio.github.io/keras/articles/
    writing_your_own_callbacks.html): a callback's per-batch logs. Keras reports the running
    mean; the towers' is the same mean of per-example losses summed in another order
    (within γ_k relative, k ≤ 192 additions: 1.1e-5), of weights that differ by the
    reassociation above (≤ 1e-4 of a movement of ~1e-2): 2e-5 relative in all."""
    x, y = _classes()
    calls = {id_: BatchLosses() for id_ in ("tm", "one")}
    order = iter(("tm", "one"))
    tm, one, start = both(_mlp(), lambda: {"optimizer": keras.optimizers.SGD(0.1),
                                           "loss": SCE},
                          lambda m: m.fit(x, y, batch_size=48, epochs=2, shuffle=False,
                                          verbose=0, callbacks=[calls[next(order)]]))
    close(tm.get_weights(), one.get_weights(), start)
    assert len(calls["tm"].batches) == len(calls["one"].batches) == 8
    assert calls["tm"].epochs == calls["one"].epochs == [0, 1]
    np.testing.assert_allclose(calls["tm"].batches, calls["one"].batches, rtol=2e-5)


def test_sample_and_class_weights() -> None:
    """Training & evaluation with the built-in methods (https://cocalc.com/github/
    keras-team/keras-io/blob/master/guides/training_with_built_in_methods.py): sample_weight
    in one run, class_weight in another, each against one device."""
    x, y = _classes(seed=4)
    w = rng(5).uniform(0.1, 2.0, 192).astype("f4")
    for extra in ({"sample_weight": w}, {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}}):
        tm, one, start = both(_mlp(4), lambda: {"optimizer": keras.optimizers.SGD(0.1),
                                                "loss": SCE},
                              lambda m, e=extra: m.fit(x, y, batch_size=64, epochs=2,
                                                       shuffle=False, verbose=0, **e))
        close(tm.get_weights(), one.get_weights(), start)


def test_learning_rate_schedule_with_clipping() -> None:
    """A LearningRateSchedule (https://keras.io/api/optimizers/learning_rate_schedules/
    learning_rate_schedule) with global_clipnorm: the towers clip the reduced gradient,
    as one device does (docs/keras.md), and step the schedule once per batch."""
    x, y = _classes(seed=6)

    def args() -> dict:
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([2, 4], [0.3, 0.1, 0.03])
        return {"optimizer": keras.optimizers.SGD(schedule, global_clipnorm=0.5), "loss": SCE}

    tm, one, start = both(_mlp(6), args, lambda m: m.fit(x, y, batch_size=32, epochs=1,
                                                          shuffle=False, verbose=0))
    close(tm.get_weights(), one.get_weights(), start)
    assert int(tm.optimizer.iterations) == int(one.optimizer.iterations) == 6


def test_adapted_normalization_regression() -> None:
    """TensorFlow's Basic regression tutorial (https://www.sipoch.com/en/article/
    300330019078707, from tensorflow.org): Normalization adapted on the features, then
    Dense layers, MAE loss, Adam. The adapted statistics must hold on every tower in fit,
    evaluate and predict."""
    r = rng(7)
    x = (r.normal(size=(256, 4)) * [1, 50, 400, 3000] + [4, 200, 100, 3000]).astype("f4")
    y = (x @ np.array([1.0, 0.05, -0.01, -0.002], "f4") + 30).astype("f4")

    def build() -> keras.Model:
        keras.utils.set_random_seed(7)
        norm = keras.layers.Normalization()
        norm.adapt(x)
        inputs = keras.Input((4,))
        h = keras.layers.Dense(8, activation="relu")(norm(inputs))
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    tm, one, start = both(build, lambda: {"optimizer": keras.optimizers.SGD(0.01),
                                          "loss": "mean_absolute_error"},
                          lambda m: m.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                                          verbose=0))
    close(tm.get_weights(), one.get_weights(), start)
    np.testing.assert_allclose(tm.predict(x[:10], verbose=0), one.predict(x[:10], verbose=0),
                               rtol=1e-4)
    np.testing.assert_allclose(tm.evaluate(x, y, verbose=0), one.evaluate(x, y, verbose=0),
                               rtol=1e-4)


def test_string_lookup_adapted_in_the_model() -> None:
    """Working with preprocessing layers: an adapted StringLookup (one-hot) inside the
    model; its table must be there on every tower for fit, evaluate and predict."""
    words = np.array(["a", "b", "c", "d", "e", "f"])
    r = rng(8)
    x = words[r.integers(0, 6, 192)][:, None]
    y = np.isin(x[:, 0], ["a", "c", "e"]).astype("f4")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)  # strings go as tensors

    def build() -> keras.Model:
        keras.utils.set_random_seed(8)
        lookup = keras.layers.StringLookup(output_mode="one_hot")
        lookup.adapt(words)
        inputs = keras.Input((1,), dtype="string")
        h = keras.layers.Dense(4, activation="relu")(lookup(inputs))
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    tm, one, start = both(build, lambda: {"optimizer": keras.optimizers.SGD(0.2),
                                          "loss": keras.losses.BinaryCrossentropy(
                                              from_logits=True)},
                          lambda m: m.fit(data, epochs=2, verbose=0))
    close(tm.get_weights(), one.get_weights(), start)
    probe = tf.constant(x[:12])
    np.testing.assert_allclose(tm.predict(probe, verbose=0), one.predict(probe, verbose=0),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(tm.evaluate(data, verbose=0), one.evaluate(data, verbose=0),
                               rtol=1e-4)
