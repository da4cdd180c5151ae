"""Guides as tests, continued: text, augmentation, mixed precision, custom layers and models,
transfer learning, tf.data, ``steps_per_execution`` and save/load/continue. The tolerance
``close`` and its derivation are in tests/model/test_guides.py."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from tests.model.test_guides import SCE, _classes, _mlp, both, close, rng, towered

pytestmark = pytest.mark.long


def test_text_classification_with_text_vectorization_in_tf_data() -> None:
    """TensorFlow's Text classification tutorial (https://raw.githubusercontent.com/
    tensorflow/docs/MarkDaoust-patch-1/site/en/tutorials/keras/text_classification.ipynb):
    a TextVectorization adapted on the raw text and mapped over a tf.data pipeline, then
    Embedding → GlobalAveragePooling1D → Dense(1) with binary crossentropy."""
    good, bad = ["great", "fine", "superb"], ["awful", "dull", "poor"]
    filler = ["the", "a", "movie", "plot"]
    r = rng(10)
    texts, labels = [], []
    for _ in range(192):
        label = int(r.integers(0, 2))
        words = list(r.choice(filler, 4)) + list(r.choice(good if label else bad, 2))
        r.shuffle(words)
        texts.append(" ".join(words))
        labels.append(label)
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=8)
    vectorize.adapt(texts)

    def data() -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((texts, np.array(labels, "f4")))
        return ds.batch(64).map(lambda x, y: (vectorize(x), y)).cache()

    def build() -> keras.Model:
        keras.utils.set_random_seed(10)
        inputs = keras.Input((8,), dtype="int64")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(inputs))
        return keras.Model(inputs, keras.layers.Dense(1)(h))

    tm, one, start = both(build, lambda: {
        "optimizer": keras.optimizers.SGD(0.5),
        "loss": keras.losses.BinaryCrossentropy(from_logits=True), "metrics": ["accuracy"]},
        lambda m: m.fit(data(), epochs=2, verbose=0))
    close(tm.get_weights(), one.get_weights(), start)
    np.testing.assert_allclose(tm.evaluate(data(), verbose=0), one.evaluate(data(), verbose=0),
                               rtol=1e-4)


def test_data_augmentation_layers_in_the_model() -> None:
    """TensorFlow's Data augmentation tutorial (https://raw.githubusercontent.com/tensorflow/
    docs/MarkDaoust-patch-1/site/en/tutorials/images/data_augmentation.ipynb): RandomFlip
    inside the model, active in training only. On left-right symmetric images a horizontal
    flip is the identity, so the towers must train as one device does (within ``close``);
    on asymmetric images the flips are real and the weights leave the unaugmented run's."""

    def build(augment: bool = True) -> keras.Model:
        keras.utils.set_random_seed(11)
        inputs = keras.Input((6, 6, 1))
        h = keras.layers.RandomFlip("horizontal", seed=3)(inputs) if augment else inputs
        h = keras.layers.Conv2D(3, 3, activation="relu")(h)
        h = keras.layers.Flatten()(h)
        return keras.Model(inputs, keras.layers.Dense(2)(h))

    r = rng(11)
    half = r.normal(size=(128, 6, 3, 1)).astype("f4")
    symmetric = np.concatenate([half, half[:, :, ::-1]], axis=2)
    asymmetric = r.normal(size=(128, 6, 6, 1)).astype("f4")
    y = r.integers(0, 2, 128)

    def args() -> dict:
        return {"optimizer": keras.optimizers.SGD(0.05), "loss": SCE}

    tm, one, start = both(build, args, lambda m: m.fit(symmetric, y, batch_size=32, epochs=1,
                                                        shuffle=False, verbose=0))
    close(tm.get_weights(), one.get_weights(), start)
    flipped = towered(build)
    flipped.compile(**args())
    plain = towered(lambda: build(augment=False))
    plain.compile(**args())
    for m in (flipped, plain):
        m.fit(asymmetric, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    gap = max(float(np.abs(a - b).max())
              for a, b in zip(flipped.get_weights(), plain.get_weights(), strict=True))
    assert gap > 1e-4  # the flips happened in training
    np.testing.assert_allclose(flipped.predict(asymmetric[:8], verbose=0),
                               keras.Model.predict(flipped.network, asymmetric[:8], verbose=0),
                               rtol=1e-5, atol=1e-6)  # and not in inference


def test_mixed_precision_float16() -> None:
    """The Mixed precision guide (https://tensorflow.org/versions/r2.8/api_docs/python/tf/
    keras/mixed_precision/set_global_policy): ``mixed_float16`` compute, float32 variables,
    compile's automatic loss scaling. Tolerance: the forward pass rounds to float16
    (u = 2⁻¹¹) per row, the same on every tower; what differs is the float32 gradient sum,
    as in float32 training, plus the loss-scale division: 1e-3 of the movement (measured
    below 1e-5; kept loose for float16's coarser gradients)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = _classes(seed=12)
        tm, one, start = both(_mlp(12), lambda: {"optimizer": keras.optimizers.SGD(0.1),
                                                 "loss": SCE},
                              lambda m: m.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                                              verbose=0))
        assert isinstance(one.optimizer, keras.optimizers.LossScaleOptimizer)
        assert tm.network.layers[1].compute_dtype == "float16"
    finally:
        keras.mixed_precision.set_global_policy("float32")
    close(tm.get_weights(), one.get_weights(), start, rtol=1e-3)


class ActivityPenalty(keras.layers.Layer):
    """Making new layers via subclassing: a layer that adds a loss with ``add_loss``."""

    def __init__(self, rate: float = 0.1, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        self.add_loss(self.rate * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def test_custom_layer_with_add_loss() -> None:
    """Making new layers and models via subclassing, add_loss (https://keras.io/guides/
    making_new_layers_and_models_via_subclassing): the penalty is in the training loss and
    in evaluate's. The weights follow one device's, which they would not without the
    penalty (checked: a run with rate 0 ends farther than the bound)."""
    x, y = _classes(seed=13)

    def build(rate: float = 1.0) -> keras.Model:
        keras.utils.set_random_seed(13)
        inputs = keras.Input((5,))
        h = ActivityPenalty(rate)(keras.layers.Dense(8, activation="relu")(inputs))
        return keras.Model(inputs, keras.layers.Dense(3)(h))

    def fit(m: keras.Model) -> None:
        m.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)

    def args() -> dict:
        return {"optimizer": keras.optimizers.SGD(0.1), "loss": SCE}

    tm, one, start = both(build, args, fit)
    close(tm.get_weights(), one.get_weights(), start)
    np.testing.assert_allclose(tm.evaluate(x, y, verbose=0), one.evaluate(x, y, verbose=0),
                               rtol=1e-4)
    unpenalized = towered(lambda: build(0.0))
    unpenalized.compile(**args())
    fit(unpenalized)
    with pytest.raises(AssertionError):
        close(unpenalized.get_weights(), one.get_weights(), start)


class Classifier(keras.Model):
    """A subclassed model as the subclassing guide writes one."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.drop = keras.layers.Dropout(0.0)
        self.out = keras.layers.Dense(3)

    def call(self, inputs: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.out(self.drop(self.hidden(inputs), training=training))


def test_subclassed_model_from_a_factory() -> None:
    """Making new layers and models via subclassing (https://cocalc.com/github/keras-team/
    keras-io/blob/master/guides/making_new_layers_and_models_via_subclassing.py): a
    ``keras.Model`` subclass, given to TowerModel as a factory (it cannot be cloned)."""
    x, y = _classes(seed=14)

    def make() -> keras.Model:
        keras.utils.set_random_seed(14)
        model = Classifier()
        model(np.zeros((1, 5), "f4"))  # build by calling, as the guide does
        return model

    one = make()
    start = [w.copy() for w in one.get_weights()]
    tm = towers.TowerModel(make, devices=DEVICES[:3], all_reduce="naive",
                           variables="replicated")
    for m in (tm, one):
        m.compile(keras.optimizers.Adam(0.01), SCE)
        m.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    # Adam divides by sqrt(v): a reassociated gradient moves the step by about the same
    # relative amount, not more (ε keeps the divisor away from 0)
    close(tm.get_weights(), one.get_weights(), start)


def _transfer() -> tuple[towers.TowerModel, keras.Model, list[np.ndarray], list[np.ndarray]]:
    """Freeze a pretrained base, train a head (SGD 0.1), unfreeze, fine-tune (SGD 0.01),
    through 4 towers and under MirroredStrategy. Returns (towers, reference, the frozen
    base's weights, the weights after the frozen stage)."""
    x, y = _classes(seed=15)
    keras.utils.set_random_seed(15)

    def base() -> keras.Model:
        base_in = keras.Input((5,))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(6, activation="relu")(base_in))
        return keras.Model(base_in, h, name="base")

    pretrained = base()
    pretrained.compile(keras.optimizers.SGD(0.1), "mse")
    pretrained.fit(x, rng(15).normal(size=(192, 6)).astype("f4"), epochs=1, verbose=0)
    frozen = pretrained.get_weights()

    def build() -> keras.Model:
        keras.utils.set_random_seed(16)
        b = base()
        b.set_weights(frozen)
        b.trainable = False
        inputs = keras.Input((5,))
        return keras.Model(inputs, keras.layers.Dense(3)(b(inputs, training=False)))

    strategy = tf.distribute.MirroredStrategy(
        DEVICES[:4], cross_device_ops=tf.distribute.ReductionToOneDevice())
    tm = towered(build)
    with strategy.scope():
        ref = build()
    after_frozen: list[np.ndarray] = []
    for lr in (0.1, 0.01):
        for m in (tm, ref):
            if lr == 0.01:  # fine-tuning: the user unfreezes the base they hold
                (m.network if m is tm else m).get_layer("base").trainable = True
            with (strategy if m is ref else tf.distribute.get_strategy()).scope():
                m.compile(keras.optimizers.SGD(lr), SCE)
            m.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        if lr == 0.1:
            after_frozen = tm.get_weights()
            for got, want in zip(ref.get_weights(), after_frozen, strict=True):
                np.testing.assert_array_equal(got, want)
    return tm, ref, frozen, after_frozen


def test_transfer_learning_freeze_then_fine_tune() -> None:
    """Transfer learning & fine-tuning (https://gitverse.ru/githubmirror/keras/content/
    master/guides/transfer_learning.py): a pretrained base with BatchNorm is frozen
    (``trainable = False``, called with ``training=False``), a new head trains; then the
    base is unfrozen and the model recompiled with a low rate. The reference is
    MirroredStrategy (ReductionToOneDevice), which docs/keras.md claims bitwise for a
    functional model: under Keras 3 the unfrozen BatchNorm normalizes each replica's own
    rows (measured: its moving statistics move), which one device does not. The frozen
    stage leaves the base bitwise untouched; every trainable weight matches bitwise after
    fine-tuning (the moving statistics: the next test)."""
    tm, ref, frozen, after_frozen = _transfer()
    for got, want in zip(after_frozen[:len(frozen)], frozen, strict=True):
        np.testing.assert_array_equal(got, want)
    trainable = [0, 1, 2, 3, 6, 7]  # Dense, BatchNorm's gamma and beta, the head
    got, want = tm.get_weights(), ref.get_weights()
    for i in trainable:
        np.testing.assert_array_equal(got[i], want[i], err_msg=f"weight {i}")
    assert not np.array_equal(got[0], frozen[0])  # fine-tuning moved the base


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "after unfreezing, BatchNorm's moving_mean under TowerModel(naive, replicated) is not "
    "MirroredStrategy(ReductionToOneDevice)'s: all 6 elements differ (max 5.1e-3 on values "
    "near 0.03, 14 % relative) after 3 fine-tuning steps; towers' moving_mean moves as one "
    "device's does (0.013337 vs 0.013337), MirroredStrategy's less (0.010278)"))
def test_transfer_learning_moving_statistics_equal_mirrored() -> None:
    """The same run: BatchNorm's moving statistics after fine-tuning, bitwise as claimed."""
    tm, ref, _, _ = _transfer()
    for i in (4, 5):
        np.testing.assert_array_equal(tm.get_weights()[i], ref.get_weights()[i],
                                      err_msg=f"weight {i}")


def test_tf_data_pipeline_shuffle_map_batch_prefetch() -> None:
    """tf.data: Build TensorFlow input pipelines: from_tensor_slices → seeded shuffle →
    map → batch → prefetch; each model reads its own equal pipeline."""
    x, y = _classes(seed=16)

    def data() -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(192, seed=4)
        ds = ds.map(lambda a, b: (a * 2.0, b), num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(32).prefetch(tf.data.AUTOTUNE)

    tm, one, start = both(_mlp(16), lambda: {"optimizer": keras.optimizers.SGD(0.1),
                                             "loss": SCE},
                          lambda m: m.fit(data(), epochs=2, verbose=0))
    close(tm.get_weights(), one.get_weights(), start)


def test_steps_per_execution() -> None:
    """``compile(steps_per_execution=3)`` (https://Keras.io/api/models/model_training_apis):
    three batches per function call, the same training as one batch per call on one
    device; the optimizer counts every batch."""
    x, y = _classes(seed=17)
    one = _mlp(17)()
    start = [w.copy() for w in one.get_weights()]
    one.compile(keras.optimizers.SGD(0.1), SCE)
    tm = towered(_mlp(17))
    tm.compile(keras.optimizers.SGD(0.1), SCE, steps_per_execution=3)
    for m in (tm, one):
        m.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert int(tm.optimizer.iterations) == int(one.optimizer.iterations) == 12
    close(tm.get_weights(), one.get_weights(), start)


def test_save_load_and_continue(tmp_path: Path) -> None:
    """Save and load (the TF tutorial tutorials/keras/save_and_load, cited by
    https://github.com/adamvenroy/sentiment-classifer): fit an epoch, ``save`` a .keras
    file, ``load_model``, fit on with the restored Adam state; equal to one device doing
    the same."""
    x, y = _classes(seed=18)

    def run(m: keras.Model, name: str) -> keras.Model:
        m.compile(keras.optimizers.Adam(0.01), SCE)
        m.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        m.save(tmp_path / f"{name}.keras")
        again = keras.models.load_model(tmp_path / f"{name}.keras")
        again.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        return again

    one = _mlp(18)()
    start = [w.copy() for w in one.get_weights()]
    tm = run(towered(_mlp(18)), "towers")
    assert isinstance(tm, towers.TowerModel)
    one = run(one, "one")
    assert int(tm.optimizer.iterations) == int(one.optimizer.iterations) == 6
    close(tm.get_weights(), one.get_weights(), start)


@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "a weights file written by TowerModel.save_weights does not load into the plain "
    "keras.Model it wraps: load_weights raises 'Layer dense_N expected 2 variables, but "
    "received 0 variables during loading' (the file nests the network under the "
    "TowerModel's own path)"))
def test_weights_saved_by_towers_serve_in_plain_keras(tmp_path: Path) -> None:
    """Train with towers, serve with plain Keras (the save_and_load tutorial's
    ``save_weights`` / ``load_weights``): the served model holds the trained weights."""
    x, y = _classes(seed=19)
    tm = towered(_mlp(19))
    tm.compile(keras.optimizers.SGD(0.1), SCE)
    tm.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    tm.save_weights(tmp_path / "served.weights.h5")
    served = _mlp(0)()
    served.load_weights(tmp_path / "served.weights.h5")
    for got, want in zip(served.get_weights(), tm.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(served.predict(x[:8], verbose=0),
                                  keras.Model.predict(tm.network, x[:8], verbose=0))
