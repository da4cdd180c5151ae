"""Losses as Keras's ``compile`` prepares them (towers/training/losses.py: ``resolve_loss``,
``per_example_loss``): labels brought to the output's rank, per-timestep sample weights.

Reference: the same network on one device, plain Keras ``compile``/``fit`` on the same
batches. Both add the same per-example terms in different orders (the towers split each
batch of 8 over 3 towers as [3, 3, 2]); float32 rounding of a few sums of ≤ 16 terms
with SGD's rate 0.1 stays below 1e-6 in these weights (measured ≤ 6e-8), while a label
broadcast to ``(b, b)`` or a weight applied to the wrong axis is off by ≥ 1e-3.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES

TOWERS = 3
ATOL = 1e-6


def _dense_net(outputs: int, activation: str | None = None) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(outputs, activation=activation)(hidden))


def _both(net: Callable[[], keras.Model], loss: object, x: np.ndarray, y: np.ndarray,
          **fit: object) -> tuple[keras.Model, towers.TowerModel, dict, dict]:  # fmt: skip
    one = net()
    one.compile(keras.optimizers.SGD(0.1), loss)
    want = one.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **fit).history
    tm = towers.TowerModel(net(), devices=DEVICES[:TOWERS], variables="replicated")
    tm.compile(keras.optimizers.SGD(0.1), loss)
    got = tm.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **fit).history
    return one, tm, want, got


def _assert_weights_close(one: keras.Model, tm: towers.TowerModel) -> None:
    for a, b in zip(tm.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


@pytest.mark.long
@pytest.mark.parametrize("loss", ["hinge", "kl_divergence", "poisson", "binary_crossentropy",
                                  keras.losses.hinge])  # fmt: skip
def test_labels_of_one_rank_less_than_the_output_are_expanded_as_keras_does(loss: object) -> None:
    # labels (B,) against a (B, 1) output: unexpanded they broadcast to (b, b) per tower
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 5)).astype("f4")
    y = (rng.random(16) > 0.5).astype("f4")
    one, tm, want, got = _both(lambda: _dense_net(1, "sigmoid"), loss, x, y)
    _assert_weights_close(one, tm)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


def _sequence_net() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 4))
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(5, "tanh")(inputs)))


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", pytest.param(
    "mean_with_sample_weight", marks=pytest.mark.long)])
def test_per_timestep_sample_weights_weigh_each_loss_value_as_keras_does(reduction: str) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 6, 4)).astype("f4")
    y = rng.integers(0, 3, size=(16, 6))
    weights = (rng.random((16, 6)) > 0.3) * rng.uniform(0.5, 2.0, (16, 6))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    one, tm, want, got = _both(_sequence_net, loss, x, y, sample_weight=weights.astype("f4"))
    _assert_weights_close(one, tm)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    # evaluate, with a short last batch (16 = 10 + 6)
    np.testing.assert_allclose(
        tm.evaluate(x, y, sample_weight=weights, batch_size=10, verbose=0),
        one.evaluate(x, y, sample_weight=weights, batch_size=10, verbose=0), rtol=1e-5)


def test_an_element_weight_that_fits_no_loss_value_is_refused_by_name() -> None:
    # a per-timestep weight for a loss with one value per example (a (B, 3) output, (B,)
    # labels): Keras would broadcast it somewhere; towers names the shapes
    rng = np.random.default_rng(3)
    trainer = towers.TowerTrainer(_dense_net(3), keras.optimizers.SGD(0.1),
                                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                  devices=DEVICES[:TOWERS])  # fmt: skip
    before = trainer.get_weights()
    with pytest.raises(ValueError, match=r"sample_weight of shape .* weighs the loss's elements"):
        trainer.train_step(rng.normal(size=(8, 5)).astype("f4"), np.arange(8) % 3,
                           sample_weight=np.ones((8, 4), "f4"))  # fmt: skip
    for a, b in zip(trainer.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_sum_reduction_adds_every_value_of_a_sequence_loss() -> None:
    # Keras's "sum" adds all B·T values; averaging the T axis first trained on loss / T
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 6, 4)).astype("f4")
    y = rng.integers(0, 3, size=(16, 6))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    one, tm, want, got = _both(_sequence_net, loss, x, y)
    _assert_weights_close(one, tm)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


@pytest.mark.long
@pytest.mark.parametrize(("units", "labels"), [(1, "binary"), (3, "sparse"), (3, "one-hot")])
@pytest.mark.parametrize("alias", ["crossentropy", "ce"])
def test_the_crossentropy_alias_picks_the_loss_keras_picks(units: int, labels: str,
                                                           alias: str) -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(16, 5)).astype("f4")
    classes = rng.integers(0, max(units, 2), size=16)
    y = (classes.astype("f4") if labels == "binary" else classes if labels == "sparse"
         else np.eye(units, dtype="f4")[classes])  # fmt: skip
    activation = "sigmoid" if units == 1 else "softmax"
    one, tm, want, got = _both(lambda: _dense_net(units, activation), alias, x, y)
    _assert_weights_close(one, tm)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


# A user loss whose *output* breaks the contract, over the class: every way to lose the
# batch axis or the floating dtype is refused where the loss is first traced, naming the
# loss and both shapes, and the step that refused it changed nothing.
_BROKEN: dict[str, Callable[[object, object], object]] = {
    "mean_over_batch": lambda y, p: keras.ops.mean(keras.ops.square(y - p), keepdims=True)[0],
    "mean_scalar": lambda y, p: keras.ops.mean(keras.ops.square(y - p)),
    "batch_doubled": lambda y, p: keras.ops.concatenate([keras.ops.square(y - p)] * 2, 0),
    "batch_transposed": lambda y, p: keras.ops.transpose(keras.ops.square(y - p)),
    "integer_values": lambda y, p: keras.ops.cast(keras.ops.square(y - p) * 10, "int32"),
}


@pytest.mark.parametrize("towers_n", [1, 2, 3])
@pytest.mark.parametrize("kind", sorted(_BROKEN))
def test_a_loss_output_that_breaks_the_contract_is_refused_before_any_update(
    kind: str, towers_n: int
) -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 5)).astype("f4")
    y = rng.normal(size=(8, 2)).astype("f4")  # outputs [b, 2]: transposed is [2, b]
    trainer = towers.TowerTrainer(_dense_net(2), keras.optimizers.SGD(0.1), _BROKEN[kind],
                                  devices=DEVICES[:towers_n], all_reduce="naive")  # fmt: skip
    before = trainer.get_weights()
    with pytest.raises(ValueError, match=r"^loss must return"):
        trainer.train_step(x, y)
    for a, b in zip(trainer.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_loss_with_extra_axes_trains_as_keras_averages_them() -> None:
    """The contract's other side: values ``[batch, k]`` are accepted and averaged over
    ``k`` per example, what Keras's ``sum_over_batch_size`` does over every value."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 5)).astype("f4")
    y = rng.normal(size=(16, 2)).astype("f4")
    one, tm, want, got = _both(lambda: _dense_net(2),
                               lambda t, p: keras.ops.square(t - p), x, y)  # fmt: skip
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    _assert_weights_close(one, tm)
