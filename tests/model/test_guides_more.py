"""Guides as tests, continued: text, augmentation, mixed precision, custom layers and models,
tf.data and ``steps_per_execution``. The tolerance
``close`` and its derivation are in tests/model/test_guides.py."""

from __future__ import annotations

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
    compile's automatic loss scaling. Tolerance: the kernel gradients are float16 matmuls
    (x^T·δ, u = 2⁻¹¹) summed over each tower's rows and then across towers, so the
    worst-case reassociation bound is γ_B ≈ 64·2⁻¹¹ ≈ 3e-2 per step, too loose to catch
    anything; measured 1.8e-4 of the movement (4 towers, 2 epochs); 1e-3 is kept, 5×
    the measurement."""
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


def test_tf_data_pipeline_shuffle_map_batch_prefetch() -> None:
    """tf.data: Build TensorFlow input pipelines (https://raw.githubusercontent.com/
    tensorflow/docs/MarkDaoust-patch-1/site/en/guide/data.ipynb): from_tensor_slices →
    seeded shuffle → map → batch → prefetch; each model reads its own equal pipeline."""
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
