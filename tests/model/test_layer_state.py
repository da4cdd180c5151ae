"""A replica is the whole model: layer state Keras keeps outside variables (adapted
statistics, lookup tables) is there for training, evaluation, prediction and validation.

Every tower runs replica 0's network on its replica's variable values, in training and in
inference alike, so adapted preprocessing layers (``Normalization``, ``Discretization``,
``IntegerLookup``, ``StringLookup``, ``TextVectorization``) hold on every tower. Reference:
the same model on one device, Keras's own ``predict``/``evaluate`` — the inference pass
is per-example arithmetic, so each output row is computed by the same kernels on the same
values: equal within the float32 rounding of a batch-size-dependent GEMM (oneDNN may
block rows differently for different batch sizes: a few ULPs, ``rtol=1e-6``).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES, examples

RTOL = 1e-6


def _regression() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """TensorFlow's "Basic regression" shape: Normalization adapted on data far from 0."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(40, 3)) * [50.0, 2.0, 900.0] + [300.0, -7.0, 4000.0]).astype("f4")
    y = (x @ np.array([0.01, 0.3, 0.001], "f4") + rng.normal(size=40).astype("f4"))[:, None]
    norm = keras.layers.Normalization(axis=-1)
    norm.adapt(x)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), norm, keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])  # fmt: skip
    return model, x, y


def _lookup() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.choice([3, 17, 42, 99, 1000], size=(40, 1)).astype("int64")
    y = (x[:, 0] % 3).astype("int64")
    lookup = keras.layers.IntegerLookup(output_mode="one_hot")
    lookup.adapt(x)
    keras.utils.set_random_seed(2)
    inputs = keras.Input((1,), dtype="int64")
    outputs = keras.layers.Dense(3)(lookup(inputs))
    return keras.Model(inputs, outputs), x, y


def _discretize() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(40, 2)).astype("f4") * 10
    y = (x[:, 0] > 0).astype("int64")
    disc = keras.layers.Discretization(num_bins=4, output_mode="one_hot")
    disc.adapt(x[:, :1])
    keras.utils.set_random_seed(3)
    inputs = keras.Input((2,))
    h = keras.layers.Concatenate()([disc(inputs[:, :1]), inputs[:, 1:]])
    return keras.Model(inputs, keras.layers.Dense(2)(h)), x, y


def _strings() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    words = np.array([["red"], ["green"], ["blue"], ["red"], ["cyan"]] * 8)
    y = np.array([0, 1, 2, 0, 1] * 8, "int64")
    lookup = keras.layers.StringLookup(output_mode="one_hot")
    lookup.adapt(words)
    keras.utils.set_random_seed(4)
    inputs = keras.Input((1,), dtype="string")
    # a string tensor (Keras's array adapter refuses NumPy's fixed-width unicode arrays)
    return keras.Model(inputs, keras.layers.Dense(3)(lookup(inputs))), tf.constant(words), y


def _text() -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """A TextVectorization adapted on sentences, then an embedding (the text guides' shape)."""
    sentences = np.array(["the cat sat", "a dog ran far", "the dog sat down", "cats and dogs",
                          "far and away", "a cat ran"] * 7)  # fmt: skip
    y = np.array([0, 1, 1, 0, 1, 0] * 7, "int64")
    vectorize = keras.layers.TextVectorization(max_tokens=16, output_sequence_length=5)
    vectorize.adapt(sentences)
    keras.utils.set_random_seed(5)
    inputs = keras.Input((1,), dtype="string")
    h = keras.layers.Embedding(16, 4)(vectorize(inputs))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs), tf.constant(sentences[:, None]), y


CASES: dict[str, tuple[Callable[[], tuple], str]] = {
    "normalization": (_regression, "mse"),
    "integer_lookup": (_lookup, "sparse_categorical_crossentropy"),
    "discretization": (_discretize, "sparse_categorical_crossentropy"),
    "string_lookup": (_strings, "sparse_categorical_crossentropy"),
    "text_vectorization": (_text, "sparse_categorical_crossentropy"),
}


@pytest.mark.parametrize("variables", ["replicated", "parameter_device"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_adapted_layers_hold_on_every_tower(case: str, variables: str) -> None:
    make, loss = CASES[case]
    model, x, y = make()
    reference, _, _ = make()
    reference.set_weights(model.get_weights())
    reference.compile(keras.optimizers.SGD(0.01), loss)
    tm = towers.TowerModel(model, devices=DEVICES[:4], variables=variables)
    tm.compile(keras.optimizers.SGD(0.01), loss)
    # before training: every tower's rows as one device computes them
    np.testing.assert_allclose(tm.predict(x[:10], verbose=0), reference.predict(x[:10], verbose=0),
                               rtol=RTOL, atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(tm.evaluate(x, y, batch_size=10, verbose=0),
                               reference.evaluate(x, y, batch_size=10, verbose=0), rtol=1e-5)
    history = tm.fit(x, y, batch_size=10, epochs=1, validation_data=(x, y), verbose=0)
    want_val = reference.evaluate(x, y, batch_size=10, verbose=0)
    reference.set_weights(tm.get_weights())
    np.testing.assert_allclose(history.history["val_loss"][-1],
                               reference.evaluate(x, y, batch_size=10, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(tm.predict(x, batch_size=10, verbose=0),
                               reference.predict(x, batch_size=10, verbose=0),
                               rtol=RTOL, atol=1e-6)  # fmt: skip
    assert want_val != history.history["val_loss"][-1]  # it trained


@settings(max_examples=examples(ci=6))
@given(
    case=st.sampled_from(sorted(CASES)),
    n=st.integers(1, 6),
    rows=st.integers(1, 17),
    variables=st.sampled_from(["replicated", "parameter_device"]),
)
def test_inference_equals_the_plain_model_over_the_class(case: str, n: int, rows: int,
                                                         variables: str) -> None:  # fmt: skip
    """Any adapted preprocessing layer, any tower count, any batch (towers left empty
    included): predict and evaluate are what the plain Keras model computes."""
    make, loss = CASES[case]
    model, x, y = make()
    reference, _, _ = make()
    reference.set_weights(model.get_weights())
    reference.compile(keras.optimizers.SGD(0.01), loss)
    tm = towers.TowerModel(model, devices=DEVICES[:n], variables=variables)
    tm.compile(keras.optimizers.SGD(0.01), loss)
    np.testing.assert_allclose(tm.predict(x[:rows], batch_size=rows, verbose=0),
                               reference.predict(x[:rows], batch_size=rows, verbose=0),
                               rtol=RTOL, atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(tm.evaluate(x[:rows], y[:rows], batch_size=rows, verbose=0),
                               reference.evaluate(x[:rows], y[:rows], batch_size=rows, verbose=0),
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_replica_is_the_whole_model(case: str) -> None:
    """Each replica's own model object computes what the network does: the clones carry
    the adapted statistics and lookup tables, not only the variables."""
    make, loss = CASES[case]
    model, x, _ = make()
    tm = towers.TowerModel(model, devices=DEVICES[:3], variables="replicated")
    tm.compile(keras.optimizers.SGD(0.01), loss)
    want = np.asarray(tm.network(x[:6]))
    for replica in tm.trainer.replicas[1:]:
        assert replica.model is not tm.network
        np.testing.assert_allclose(np.asarray(replica.model(x[:6])), want, rtol=RTOL, atol=1e-6)
