"""towers.testing.bounds.optimizers: real Keras optimizers on two gradients within an error.

Each case steps two copies of a Keras optimizer, teacher-forced (both start every step
from the same weights, slots carried), with gradients ``g`` and ``g + e·s`` (``s``
random signs: the corners of the error box, where every rule here is extreme). The
bound must hold on every element of every step (never violated) and be attained within
a factor of 2 by some element of each step (tight). Measured on 20 seeds × 3 steps × 64
elements per optimizer with ``e`` = 1e-3 or 0.1 of ``|g|``: the largest ``diff/bound``
of a step was never below 0.968 (Adam); at 1e-6 of ``|g|`` the rounding terms (counted
per run, a few ULPs) dominate and it fell to 0.55 (RMSprop with momentum), so tightness
is asserted only where the propagated error dominates rounding.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from towers.testing.bounds.optimizers import (
    BOUNDED,
    ZERO_GRADIENT_NOISE,
    Interval,
    pieces,
    update_bounds,
)

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "rmsprop_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.9),
}
TIGHT = 0.5  # the bound is attained within a factor 2 (measured ≥ 0.968: module docstring)


def _run(name: str, rel: float, seed: int, steps: int = 3, n: int = 64) -> list[float]:
    """Step both copies; assert the bound per element; return each step's max diff/bound."""
    rng = np.random.default_rng(seed)
    var_a, var_b = keras.Variable(np.zeros(n, np.float32)), keras.Variable(np.zeros(n, np.float32))
    opt_a, opt_b = OPTIMIZERS[name](), OPTIMIZERS[name]()
    tracker = update_bounds(opt_a)
    ratios = []
    for _ in range(steps):
        g = (rng.normal(size=n) * np.exp(rng.normal(size=n))).astype(np.float32)
        g[rng.random(n) < 0.1] = 0  # exact zeros: the adaptive rules' worst case
        signs = np.sign(rng.normal(size=n))
        g_b = (g + (rel * np.abs(g) + rel * 1e-3) * signs).astype(np.float32)
        err = np.abs(g_b.astype(np.float64) - g)  # what float32 made of the perturbation
        w = rng.normal(size=n).astype(np.float32)
        var_a.assign(w)
        var_b.assign(w)
        opt_a.apply_gradients([(tf.constant(g), var_a)])
        opt_b.apply_gradients([(tf.constant(g_b), var_b)])
        bound = tracker.step([g], [err], weights=[w])[0]
        diff = np.abs(var_a.numpy().astype(np.float64) - var_b.numpy())
        worst = np.argmax(diff - bound)
        assert np.all(diff <= bound), (name, rel, tracker.steps, diff[worst], bound[worst])
        ratios.append(float(np.max(diff / bound)))
    return ratios


@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    rel=st.sampled_from([0.0, 1e-7, 1e-6, 1e-3, 0.1, 1.0]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(ci=24))
def test_bound_never_violated(name: str, rel: float, seed: int) -> None:
    ratios = _run(name, rel, seed)
    if rel == 0.0:  # the same gradients: the same steps, bitwise
        assert ratios == [0.0] * len(ratios)


@pytest.mark.parametrize("rel", [1e-3, 0.1], ids=["rel1e-3", "rel1e-1"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bound_is_tight(name: str, rel: float) -> None:
    assert min(_run(name, rel, seed=7)) >= TIGHT


def test_adam_turns_zero_gradient_noise_into_full_steps() -> None:
    # A variable whose exact gradient is 0, seen as ±1e-4 of rounding noise by two runs:
    # Adam divides by the noise's own size (ε = 1e-7 is far below √(1−β₂)·1e-4), so the
    # two runs move it by ≈ ±lr: a bound near 2·lr, where SGD's stays at lr·2e-4.
    lr, n = 0.01, 8
    tracker, sgd = update_bounds(keras.optimizers.Adam(lr)), update_bounds(keras.optimizers.SGD(lr))
    noise, err = np.full(n, 1e-4, np.float32), np.full(n, 2e-4)
    bound = tracker.step([noise], [err])[0]
    assert tracker.kinds == [ZERO_GRADIENT_NOISE]
    assert np.all(bound > 1.9 * lr) and np.all(bound <= 2.01 * lr)
    assert np.all(sgd.step([noise], [err])[0] < 1.01 * lr * 2e-4)  # SGD: as small as the noise
    big = tracker.step([np.ones(n, np.float32)], [err])
    assert tracker.kinds == [BOUNDED] and big[0].shape == (n,)


def test_config_dicts_name_the_same_rule() -> None:
    opt = keras.optimizers.Nadam(0.01)
    g, e = [np.linspace(-1, 1, 5, dtype=np.float32)], [np.full(5, 1e-4)]
    from_object, from_config = update_bounds(opt), update_bounds(opt.get_config())
    from_serialized = update_bounds(keras.optimizers.serialize(opt))
    expected = from_object.step(g, e)[0]
    np.testing.assert_array_equal(from_config.step(g, e)[0], expected)
    np.testing.assert_array_equal(from_serialized.step(g, e)[0], expected)
    assert from_config.name == from_serialized.name == "Nadam"


@pytest.mark.parametrize(
    "optimizer, match",
    [
        (keras.optimizers.SGD(0.1, clipnorm=1.0), "clipnorm=1.0"),
        (keras.optimizers.RMSprop(centered=True), "centered=True"),
        (keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
         "float learning_rate"),
        (keras.optimizers.Adagrad(), "got Adagrad"),
        ({"name": "mine"}, "got 'mine'"),
        ("adam", "Keras optimizer or its config dict"),
    ],
    ids=["clipnorm", "centered", "schedule", "adagrad", "unknown-config", "string"],
)
def test_refuses_what_it_cannot_bound(optimizer, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        update_bounds(optimizer)


def test_bad_step_inputs_name_the_argument() -> None:
    tracker = update_bounds(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="one array per variable"):
        tracker.step([np.zeros(2)], [])
    with pytest.raises(ValueError, match=r"grad_errors\[0\] must have grads\[0\]'s shape"):
        tracker.step([np.zeros(2)], [np.zeros(3)])
    with pytest.raises(ValueError, match=r"grad_errors\[0\] must be >= 0"):
        tracker.step([np.zeros(2)], [-np.ones(2)])
    with pytest.raises(ValueError, match="must be finite"):
        tracker.step([np.array([np.nan])], [np.zeros(1)])


def test_pieces_cover_the_interval() -> None:
    x = Interval(np.array([-1.0, 2.0]), np.array([3.0, 2.0]))
    cut = pieces(x, 4)
    assert cut.lo.shape == (4, 2)
    np.testing.assert_array_equal(cut.union().lo, x.lo)
    np.testing.assert_array_equal(cut.union().hi, x.hi)
    assert (x * x).lo.tolist() == [-3.0, 4.0] and x.square().lo.tolist() == [0.0, 4.0]
