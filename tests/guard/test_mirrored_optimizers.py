"""semantics="mirrored" is MirroredStrategy's ``fit`` bitwise for every Keras optimizer
and learning-rate schedule.

Inside MirroredStrategy's step Grappler's arithmetic optimizer rewrites the update
(``lr·g / sqrt(v + ε)`` of RMSprop, Adagrad, Adadelta, Ftrl, Adafactor: the last bits);
under ``"mirrored"`` a ``TowerModel`` applies its update with the same rewrites on, its
reduction still as written in the strategy's order
(:func:`towers.guard.semantics.strategy_rewrites`). Measured before that, on 4 towers,
3 steps: SGD (with momentum, Nesterov), Adam (AMSGrad), AdamW, Adamax, Nadam, Lion and
every schedule under Adam or SGD were already bitwise; RMSprop (with momentum, centered,
Keras's ``"rmsprop"``), Adagrad, Adadelta, Ftrl and Adafactor differed by up to 6e-8.
Centered RMSprop needs one more of the strategy's rewrites: constant folding turns its
``(v - ḡ²) + ε`` into ``(ε - ḡ²) + v`` only in a graph with a fetch, so the apply returns
one that the step reads (3 of 163 elements 3e-8 apart without it).
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

OPT, S = keras.optimizers, keras.optimizers.schedules
OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd_momentum": lambda: OPT.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: OPT.SGD(0.05, momentum=0.9, nesterov=True),
    "adam_amsgrad": lambda: OPT.Adam(0.01, amsgrad=True),
    "adamw": lambda: OPT.AdamW(0.01),
    "adamax": lambda: OPT.Adamax(0.01),
    "adagrad": lambda: OPT.Adagrad(0.05),
    "adadelta": lambda: OPT.Adadelta(1.0),
    "nadam": lambda: OPT.Nadam(0.01),
    "ftrl": lambda: OPT.Ftrl(0.05),
    "lion": lambda: OPT.Lion(0.001),
    "adafactor": lambda: OPT.Adafactor(0.01),
    "rmsprop": lambda: "rmsprop",  # Keras's compile default
    "rmsprop_momentum": lambda: OPT.RMSprop(0.01, momentum=0.9),
    "rmsprop_centered": lambda: OPT.RMSprop(0.01, centered=True),
    "rmsprop_momentum_centered": lambda: OPT.RMSprop(0.01, momentum=0.9, centered=True),
}
SCHEDULES: dict[str, Callable[[], Any]] = {
    "exponential": lambda: S.ExponentialDecay(0.01, 1, 0.9),
    "cosine": lambda: S.CosineDecay(0.01, 10),
    "cosine_warmup": lambda: S.CosineDecay(0.0, 10, warmup_target=0.01, warmup_steps=2),
    "cosine_restarts": lambda: S.CosineDecayRestarts(0.01, 2),
    "piecewise": lambda: S.PiecewiseConstantDecay([1], [0.01, 0.005]),
    "polynomial": lambda: S.PolynomialDecay(0.01, 10, 0.001),
    "inverse_time": lambda: S.InverseTimeDecay(0.01, 1, 0.5),
}
FAST = {"rmsprop", "adagrad", "rmsprop_centered", "cosine-rmsprop"}
"""In the fast suite: Keras's default and three the rewrites changed (about 40 s)."""


def _cases() -> list[Any]:
    cases = [(name, make) for name, make in OPTIMIZERS.items()]
    for name, schedule in SCHEDULES.items():  # each under an update Grappler rewrites
        cases.append((f"{name}-rmsprop", lambda s=schedule: OPT.RMSprop(s())))
        cases.append((f"{name}-sgd", lambda s=schedule: OPT.SGD(s(), momentum=0.9)))
    return [pytest.param(make, id=name, marks=() if name in FAST else pytest.mark.long)
            for name, make in cases]  # fmt: skip


def _build() -> keras.Model:
    """A default-named Sequential (``sequential_N`` sorts after ``replica_``), seeded."""
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(3)])  # fmt: skip


def fit_pair(make: Callable[[], Any], semantics: str = "mirrored",
             steps: int = 3) -> tuple[list[np.ndarray], list[np.ndarray]]:  # fmt: skip
    """``steps`` steps of ``fit`` on 4 towers, through a TowerModel (naive, replicated)
    and through MirroredStrategy with ReductionToOneDevice: both models' weights."""
    devices, loss = DEVICES[:4], keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(32 * steps, 5)).astype("f4"), rng.integers(0, 3, 32 * steps)
    ours = towers.TowerModel(_build(), devices=devices, all_reduce="naive",
                             variables="replicated", semantics=semantics)  # fmt: skip
    ours.compile(make(), loss)
    strategy = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        theirs = _build()
        theirs.compile(make(), loss)
    for model in (ours, theirs):
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return ours.get_weights(), theirs.get_weights()


@pytest.mark.parametrize("make", _cases())
def test_mirrored_fit_is_bitwise(make: Callable[[], Any]) -> None:
    ours, theirs = fit_pair(make)
    for got, want in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.long
def test_the_default_semantics_applies_as_written() -> None:
    """``"one_device"`` keeps its update as written (RMSprop's division, not Grappler's
    rewrite): rounding apart from the strategy, not a different step."""
    ours, theirs = fit_pair(lambda: OPT.RMSprop(0.01), semantics="one_device")
    gaps = [float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True)]
    assert 0 < max(gaps) < 1e-4, gaps


def test_the_apply_takes_the_callers_settings() -> None:
    """What the mirrored apply compiles under: the settings outside towers' own
    ``as_written()`` (Grappler's defaults, or off inside a caller's ``as_written()``)."""
    from towers.allreduce.machinery.base import REWRITES, as_written, callers_rewrites

    defaults = {name: None for name in REWRITES}
    assert callers_rewrites() == defaults
    with as_written():  # towers' own, around its update
        assert callers_rewrites() == defaults
        with as_written():
            assert callers_rewrites() == {name: False for name in REWRITES}
    assert callers_rewrites() == defaults
