"""towers/training/losses.py: a loss per output, as Keras's compile takes them."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.training.losses import OutputLosses

rng = np.random.default_rng(0)
X = rng.normal(size=(20, 5)).astype("f4")  # batches of 8: 8, 8 and a short 4
Y = [rng.integers(0, 3, 20), rng.integers(0, 2, 20)]


def _two_outputs() -> keras.Model:
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(3, name="a")(h),
                                keras.layers.Dense(2, name="b")(h)])  # fmt: skip


def _xent() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


COMPILES = {
    "one loss for both": lambda: {"loss": _xent()},
    "list, weights": lambda: {"loss": [_xent(), _xent()], "loss_weights": [1.0, 0.5]},
    "dict, weights": lambda: {"loss": {"a": _xent(), "b": _xent()},
                              "loss_weights": {"a": 0.3, "b": 2.0}},
}  # fmt: skip


@pytest.mark.parametrize("how", [pytest.param(h, marks=pytest.mark.long) if h == "one loss for both"
                                 else h for h in COMPILES])
def test_a_loss_per_output_fits_bitwise_as_under_mirrored_strategy(how: str) -> None:
    """Weights, accuracies and the total loss of fit (two epochs, a short last batch) and
    evaluate, against the same compile under MirroredStrategy."""
    metrics = [["accuracy"], ["accuracy"]]
    tm = towers.TowerModel(_two_outputs(), devices=DEVICES[:2], all_reduce="naive",
                           variables="replicated")  # fmt: skip
    tm.compile(keras.optimizers.SGD(0.1), metrics=metrics, **COMPILES[how]())
    with tf.distribute.MirroredStrategy(
        DEVICES[:2], cross_device_ops=tf.distribute.ReductionToOneDevice()
    ).scope():
        reference = _two_outputs()
        reference.compile(keras.optimizers.SGD(0.1), metrics=metrics, **COMPILES[how]())
    got, want = (model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
                 for model in (tm, reference))  # fmt: skip
    assert sorted(got) == sorted(want) == ["a_accuracy", "a_loss", "b_accuracy", "b_loss", "loss"]
    assert got["a_accuracy"] == want["a_accuracy"] and got["b_accuracy"] == want["b_accuracy"]
    # the total: each batch's global mean loss weighted by its size, as Keras's tracker sums
    # per-replica values; the two sums round differently (float32, 3 batches: 1e-6)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    for a, b in zip(tm.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    got, want = (model.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True)
                 for model in (tm, reference))  # fmt: skip
    assert got["a_accuracy"] == want["a_accuracy"] and got["b_accuracy"] == want["b_accuracy"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    # a_loss, b_loss: towers weighs each batch by its size, Keras counts each batch (and
    # replica) once (test_an_outputs_loss_metric_is_its_example_weighted_mean)


def test_an_outputs_loss_metric_is_its_example_weighted_mean() -> None:
    """With a learning rate of 0 the model is fixed, so ``a_loss`` must be the mean of
    output a's per-example losses over all 20 examples. Keras itself, tracing an unknown
    batch dimension, counts each batch once (the short batch of 4 as much as a batch of
    8), which differs here."""
    tm = towers.TowerModel(_two_outputs(), devices=DEVICES[:3], variables="replicated")
    tm.compile(keras.optimizers.SGD(0.0), loss=[_xent(), _xent()], loss_weights=[1.0, 0.5])
    history = tm.fit(X, Y, batch_size=8, shuffle=False, verbose=0).history
    logits = tm.network(X, training=True)
    per_example = [_xent().call(y, out).numpy().astype(np.float64) for y, out in zip(Y, logits)]
    for name, values in zip(("a", "b"), per_example):
        assert history[f"{name}_loss"][0] == pytest.approx(values.mean(), rel=1e-6)
        batch_means = [values[i:i + 8].mean() for i in range(0, 20, 8)]
        assert abs(np.mean(batch_means) - values.mean()) > 1e-4  # the two do differ here
    total = per_example[0] + 0.5 * per_example[1]
    assert history["loss"][0] == pytest.approx(total.mean(), rel=1e-6)


@pytest.mark.parametrize("variables", ["parameter_device",
                                       pytest.param("sharded", marks=pytest.mark.long)])
def test_every_placement_trains_a_loss_per_output_as_replicated(variables: str) -> None:
    def fitted(variables: str) -> list[np.ndarray]:
        all_reduce = "ring" if variables != "parameter_device" else None
        tm = towers.TowerModel(_two_outputs(), devices=DEVICES[:3], variables=variables,
                               all_reduce=all_reduce)  # fmt: skip
        tm.compile(keras.optimizers.SGD(0.1), loss={"a": _xent(), "b": _xent()},
                   loss_weights={"a": 1.0, "b": 0.25})  # fmt: skip
        tm.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
        return tm.get_weights()

    # parameter_device sums with its own algorithm (another order than the ring's), so
    # three SGD steps of weights ~1e-2 differ by float32 roundings: rtol 1e-6 (measured 1.0e-6
    # at worst on entries of 2e-3), atol 1e-7 for entries near 0
    got, want = fitted(variables), fitted("replicated")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


def test_a_trainer_takes_a_list_of_losses_and_an_output_left_out() -> None:
    """TowerTrainer directly: a dict that names only output b trains b's head alone (a's
    head gets no gradient: refused by name, as any variable that does not reach the loss)."""
    trainer = towers.TowerTrainer(_two_outputs, keras.optimizers.SGD(0.1), [_xent(), _xent()],
                                  devices=DEVICES[:2])  # fmt: skip
    loss = float(trainer.train_step(X[:8], [Y[0][:8], Y[1][:8]]))
    logits = _two_outputs()(X[:8])
    want = sum(float(tf.reduce_mean(_xent().call(y[:8], out))) for y, out in zip(Y, logits))
    assert loss == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="no gradient for trainable variable"):
        towers.TowerTrainer(_two_outputs, keras.optimizers.SGD(0.1), {"b": _xent()},
                            devices=DEVICES[:2]).train_step(X[:8], [Y[0][:8], Y[1][:8]])


BAD: list[tuple[dict[str, Any], type, str]] = [
    ({"loss": [_xent()]}, ValueError, r"loss: 1 entries for a model with 2 outputs \(a, b\)"),
    ({"loss": {"a": _xent(), "c": _xent()}}, ValueError, r"loss: \['c'\] are not outputs"),
    ({"loss": _xent(), "loss_weights": 0.5}, TypeError, "loss_weights must be a list or a dict"),
    ({"loss": [_xent(), _xent()], "loss_weights": [1.0]}, ValueError,
     "loss_weights: 1 entries for a model with 2 outputs"),
    ({"loss": [_xent(), keras.losses.SparseCategoricalCrossentropy(reduction="sum")]},
     ValueError, "every output's loss must ask for the same reduction"),
    ({"loss": {"a": None, "b": None}}, ValueError, "no output of the model"),
]  # fmt: skip


@pytest.mark.parametrize("compile_args,error,message", BAD)
def test_losses_that_do_not_fit_the_outputs_are_refused_at_compile(
    compile_args: dict[str, Any], error: type, message: str
) -> None:
    tm = towers.TowerModel(_two_outputs(), devices=DEVICES[:2], variables="replicated")
    with pytest.raises(error, match=message):
        tm.compile(keras.optimizers.SGD(0.1), **compile_args)


def test_output_losses_sum_weighted_per_example_losses() -> None:
    losses = OutputLosses({"b": "mse", "a": "mae"}, {"a": 2.0}).bind(_two_outputs())
    y_true = [tf.ones([4, 3]), tf.zeros([4, 2])]
    y_pred = [tf.zeros([4, 3]), tf.fill([4, 2], 3.0)]
    np.testing.assert_array_equal(losses(y_true, y_pred), [2.0 * 1.0 + 9.0] * 4)
    with pytest.raises(ValueError, match="y: 1 parts for a model with 2 outputs"):
        losses([tf.ones([4, 3])], y_pred)


def test_a_one_entry_list_for_one_output_is_the_loss_itself() -> None:
    """``loss=["mse"]``, ``loss_weights=[1.0]`` on a one-output model (valid Keras): the
    weights train bitwise as ``loss="mse"``."""

    def fitted(**compile_args: Any) -> list[np.ndarray]:
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2, name="out")])
        tm = towers.TowerModel(model, devices=DEVICES[:3], variables="replicated")
        tm.compile(keras.optimizers.SGD(0.1), **compile_args)
        tm.fit(X, np.stack(Y, 1).astype("f4"), batch_size=8, shuffle=False, verbose=0)
        return tm.get_weights()

    for a, b in zip(fitted(loss=["mse"], loss_weights=[1.0]), fitted(loss="mse"), strict=True):
        np.testing.assert_array_equal(a, b)
