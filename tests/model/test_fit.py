"""TowerModel under Keras's own loop: every input kind and fit option (priority: the input table).

The reference for "works" is the towers step itself: ``fit`` over unshuffled arrays must
give bitwise the weights of ``trainer.train_step`` called on the same batches, so the
Keras loop adds nothing to the step's arithmetic.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from tests.model.helpers import (
    LOSS,
    N,
    assert_replicas_equal,
    data,
    network,
    reset,
    tower_model,
)

X, Y = data(40)


@pytest.fixture(scope="module")
def shared() -> tuple[towers.TowerModel, list[np.ndarray], list[np.ndarray], float]:
    """One replicated TowerModel (traced once), its first weights, and its weights and
    loss after one unshuffled epoch over (X, Y) in batches of 16."""
    tm = tower_model("replicated", all_reduce=None)
    start = tm.get_weights()
    history = tm.fit(X, Y, batch_size=16, shuffle=False, verbose=0)
    return tm, start, tm.get_weights(), history.history["loss"][0]


@pytest.fixture
def tm(shared: tuple[towers.TowerModel, list[np.ndarray], list[np.ndarray]]) -> towers.TowerModel:
    reset(shared[0], shared[1])
    return shared[0]


def test_fit_is_the_towers_step_batch_after_batch(shared: tuple[Any, ...]) -> None:
    trainer = towers.TowerTrainer(network(), keras.optimizers.SGD(0.1), LOSS,
                                  devices=DEVICES[:N], variables="replicated")
    losses = [float(trainer.train_step(X[i:i + 16], Y[i:i + 16])) for i in (0, 16, 32)]
    for got, want in zip(shared[2], trainer.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert_replicas_equal(shared[0])
    # the epoch's loss: Keras's Mean of the steps' global mean losses, weighted by batch size
    expected = np.float32(sum(loss * b for loss, b in zip(losses, (16, 16, 8))) / 40)
    np.testing.assert_allclose(shared[3], expected, rtol=1e-6)


def _generator() -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for i in range(0, 40, 16):
        yield X[i:i + 16], Y[i:i + 16]


class _Sequence(keras.utils.PyDataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return X[i * 16:(i + 1) * 16], Y[i * 16:(i + 1) * 16]


INPUTS: dict[str, Callable[[], dict[str, Any]]] = {
    "numpy": lambda: {"x": X, "y": Y, "batch_size": 16},
    "tf.data batched": lambda: {"x": tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)},
    "generator": lambda: {"x": _generator()},
    "PyDataset": lambda: {"x": _Sequence()},
}


@pytest.mark.parametrize("kind", list(INPUTS))
def test_every_input_kind_trains_the_same_batches(
    kind: str, tm: towers.TowerModel, shared: tuple[Any, Any, list[np.ndarray]]
) -> None:
    history = tm.fit(**INPUTS[kind](), epochs=1, shuffle=False, verbose=0)
    assert set(history.history) == {"loss", "accuracy"}
    for got, want in zip(tm.get_weights(), shared[2], strict=True):
        np.testing.assert_array_equal(got, want)
    assert_replicas_equal(tm)


FIT_OPTIONS: dict[str, tuple[dict[str, Any], int, set[str]]] = {
    # name: (fit arguments, epochs in History, keys in History)
    "validation_data": ({"validation_data": (X[:10], Y[:10])}, 2,
                        {"loss", "accuracy", "val_loss", "val_accuracy"}),
    "validation_split": ({"validation_split": 0.25}, 2,
                         {"loss", "accuracy", "val_loss", "val_accuracy"}),
    "validation_freq": ({"validation_data": (X[:10], Y[:10]), "validation_freq": 2}, 2,
                        {"loss", "accuracy", "val_loss", "val_accuracy"}),
    "class_weight": ({"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}}, 2, {"loss", "accuracy"}),
    "sample_weight": ({"sample_weight": np.linspace(0.1, 2, 40).astype("f4")}, 2,
                      {"loss", "accuracy"}),
    "initial_epoch": ({"initial_epoch": 1}, 1, {"loss", "accuracy"}),
    "steps_per_epoch": ({"steps_per_epoch": 2, "x": tf.data.Dataset.from_tensor_slices(
        (X, Y)).batch(16).repeat(), "y": None, "batch_size": None}, 2, {"loss", "accuracy"}),
}


@pytest.mark.parametrize("option", list(FIT_OPTIONS))
def test_every_fit_option_works(option: str, tm: towers.TowerModel) -> None:
    arguments, epochs, keys = FIT_OPTIONS[option]
    before = tm.get_weights()
    call = {"x": X, "y": Y, "batch_size": 16, "epochs": 2, "verbose": 0, **arguments}
    history = tm.fit(**call)
    assert set(history.history) == keys
    assert history.epoch == list(range(2 - epochs, 2))
    if option == "validation_freq":
        assert len(history.history["val_loss"]) == 1  # epoch 2 only
    assert any(not np.array_equal(a, b) for a, b in zip(before, tm.get_weights()))
    assert_replicas_equal(tm)


def test_class_weight_is_the_matching_sample_weight(
    tm: towers.TowerModel, shared: tuple[Any, list[np.ndarray], Any]
) -> None:
    weights = {0: 1.0, 1: 3.0, 2: 0.5}
    tm.fit(X, Y, batch_size=16, shuffle=False, class_weight=weights, verbose=0)
    by_class = tm.get_weights()
    reset(tm, shared[1])
    tm.fit(X, Y, batch_size=16, shuffle=False, verbose=0,
           sample_weight=np.array([weights[int(c)] for c in Y], "f4"))
    for got, want in zip(by_class, tm.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_evaluate_and_predict_split_over_the_towers(tm: towers.TowerModel) -> None:
    loss, accuracy = tm.evaluate(X, Y, batch_size=16, verbose=0)
    logits = tm.network(X, training=False).numpy()
    # Σ of per-example losses per batch / examples: the same sum in another order
    want = float(np.mean(LOSS.call(Y, logits)))  # float32 sum of 40 numbers of size ~1
    assert abs(loss - want) <= 40 * np.finfo(np.float32).eps * 2
    assert accuracy == pytest.approx(float(np.mean(np.argmax(logits, 1) == Y)))
    np.testing.assert_allclose(tm.predict(X, batch_size=16, verbose=0), logits, rtol=1e-6,
                               atol=1e-6)  # a batch of 6 and 40 rows: oneDNN rounds per shape


def test_help_shows_keras_signatures() -> None:
    tm = towers.TowerModel(network(), devices=DEVICES[:N])
    for name in ("fit", "evaluate", "predict"):
        parameters = inspect.signature(getattr(tm, name)).parameters
        assert ("args" not in parameters and "kwargs" not in parameters) or name == "evaluate"
    assert "validation_split" in inspect.signature(tm.fit).parameters
    assert isinstance(tm, keras.Model)


@pytest.mark.parametrize(
    "compile_args, argument",
    [({"loss": None}, "loss"), ({"loss": ["mse", "mse"]}, "loss"),
     ({"loss": "mse", "loss_weights": {"no_such_output": 1.0}}, "loss_weights"),
     ({"loss": "mse", "jit_compile": True}, "jit_compile")],
    ids=["no-loss", "loss-list", "loss_weights", "jit_compile"],
)
def test_compile_refuses_what_the_step_cannot_do(compile_args: dict, argument: str) -> None:
    tm = towers.TowerModel(network(), devices=DEVICES[:N])
    with pytest.raises(ValueError, match=argument):
        tm.compile("sgd", **compile_args)


@pytest.mark.parametrize(
    "options, argument",
    [({"variables": "mirrored"}, "variables"), ({"on_nonfinite": "no"}, "on_nonfinite"),
     ({"devices": ["/CPU:99"]}, "devices"), ({"reduce_dtype": "int8"}, "reduce_dtype")],
    ids=["variables", "on_nonfinite", "devices", "reduce_dtype"],
)
def test_bad_options_are_refused_at_construction(options: dict, argument: str) -> None:
    options = {"devices": DEVICES[:N], **options}
    with pytest.raises(ValueError, match=argument):
        towers.TowerModel(network(), **options)


def test_fit_before_compile_is_keras_error() -> None:
    tm = towers.TowerModel(network(), devices=DEVICES[:N])
    with pytest.raises(ValueError, match="compile"):
        tm.fit(X, Y, verbose=0)


def test_an_unbatched_dataset_is_refused_naming_x(tm: towers.TowerModel) -> None:
    # as under plain Keras (an input of shape [5] for a model that takes [batch, 5])
    with pytest.raises(ValueError, match="x has shape"):
        tm.fit(tf.data.Dataset.from_tensor_slices((X, Y)), epochs=1, verbose=0)
