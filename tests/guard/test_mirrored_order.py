"""semantics="mirrored": the naive and parameter_device sums add in MirroredStrategy's order.

MirroredStrategy names replica 0's ops by the model (``<model>/…``) and the others
``replica_<i>/…``, and Grappler sorts an ``AddN``'s inputs by name, so
``ReductionToOneDevice`` and ``CentralStorageStrategy`` add the replicas in the order of
those names (:func:`towers.guard.semantics.mirrored_order`). Under ``semantics="mirrored"``
a ``TowerModel`` adds in that order for any model name, so its ``fit`` equals the
strategy's bitwise: default ``Sequential`` and functional names, a subclassed model named
``text_classifier``, names drawn with uppercase letters and digits, before and after
``replica_``. The default semantics adds in tower order, which is the strategy's only for
a name that sorts before ``replica_``. Twelve towers run in a subprocess (this session has
eight devices).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given
from hypothesis import strategies as st

import towers
from towers.guard.semantics import mirrored_order

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
KINDS = ("sequential", "functional", "subclassed")
"""Models as users build them: keras.Sequential and keras.Model with their default names
(``sequential_N``, ``functional_N``), and a subclass named ``text_classifier``."""


class _TextClassifier(keras.Model):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**{"name": "text_classifier", **kwargs})
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.logits = keras.layers.Dense(3)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        return self.logits(self.hidden(x))


def _build(kind: str) -> keras.Model:
    """A 5 -> 8 -> 3 network of ``kind`` (else a Sequential named ``kind``), seeded."""
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    if kind == "sequential":
        return keras.Sequential([keras.Input((5,)), *layers])
    if kind == "functional":
        inputs = keras.Input((5,))
        return keras.Model(inputs, layers[1](layers[0](inputs)))
    if kind == "subclassed":
        model = _TextClassifier()
        model(np.zeros((1, 5), "f4"))
        return model
    return keras.Sequential([keras.Input((5,)), *layers], name=kind)


def fit_pair(devices: Sequence[str], kind: str, *, semantics: str = "mirrored",
             variables: str = "replicated") -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two Adam steps of ``fit`` through a TowerModel and through its reference strategy
    (``replicated``: MirroredStrategy with ReductionToOneDevice and ``all_reduce="naive"``;
    ``parameter_device``: CentralStorageStrategy); both models' weights."""
    n = len(devices)
    rng = np.random.default_rng(n)
    x, y = rng.normal(size=(16 * n, 5)).astype("f4"), rng.integers(0, 3, 16 * n)
    naive = {"all_reduce": "naive"} if variables == "replicated" else {}
    ours = towers.TowerModel(_build(kind), devices=list(devices), variables=variables,
                             semantics=semantics, **naive)  # fmt: skip
    ours.compile(keras.optimizers.Adam(0.01), LOSS)
    if variables == "replicated":
        strategy = tf.distribute.MirroredStrategy(
            list(devices), cross_device_ops=tf.distribute.ReductionToOneDevice())
    else:
        strategy = tf.distribute.experimental.CentralStorageStrategy(
            list(devices), parameter_device=devices[0])
    with strategy.scope():
        theirs = _build(kind)
        theirs.compile(keras.optimizers.Adam(0.01), LOSS)
    for model in (ours, theirs):
        model.fit(x, y, batch_size=8 * n, epochs=1, shuffle=False, verbose=0)
    return ours.get_weights(), theirs.get_weights()


def _assert_bitwise(pair: tuple[list[np.ndarray], list[np.ndarray]]) -> None:
    for got, want in zip(*pair, strict=True):
        np.testing.assert_array_equal(got, want)


def _devices(n: int) -> list[str]:
    from tests.conftest import DEVICES

    return DEVICES[:n]


def test_the_order_is_the_measured_one() -> None:
    """Measured on TF 2.21 (``fit`` of one Dense kernel whose replicas' gradients give a
    different float32 sum in every order)."""
    assert mirrored_order("sequential", 4) == [1, 2, 3, 0]
    assert mirrored_order("sequential_3", 3) == [1, 2, 0]
    assert mirrored_order("text_classifier", 8) == [1, 2, 3, 4, 5, 6, 7, 0]
    assert mirrored_order("sequential", 12) == [1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    assert mirrored_order("Model", 12) == [0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    assert mirrored_order("replica_2x", 8) == [1, 2, 0, 3, 4, 5, 6, 7]
    assert mirrored_order("replica", 8) == mirrored_order("my_model", 8) == list(range(8))


@pytest.mark.parametrize("n", [3, *(pytest.param(n, marks=pytest.mark.long) for n in (2, 4, 8))])
@pytest.mark.parametrize("kind", KINDS)
def test_mirrored_fit_is_bitwise_for_any_keras_model(kind: str, n: int) -> None:
    _assert_bitwise(fit_pair(_devices(n), kind))


@pytest.mark.long
@given(name=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_]{0,11}", fullmatch=True),
       n=st.sampled_from([3, 4, 8]))
@example(name="replica_2x", n=8)  # between replica_2 and replica_3
@example(name="Zeta9", n=4)  # uppercase sorts before replica_
@example(name="zeta", n=4)
def test_mirrored_fit_is_bitwise_for_any_name(name: str, n: int) -> None:
    _assert_bitwise(fit_pair(_devices(n), name))


@pytest.mark.parametrize("kind,n", [("sequential", 4), ("subclassed", 3)])
def test_parameter_device_is_central_storage_strategys_order(kind: str, n: int) -> None:
    _assert_bitwise(fit_pair(_devices(n), kind, variables="parameter_device"))


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_the_default_adds_in_tower_order() -> None:
    """``sequential_N`` sorts after ``replica_``: the default's tower order is not the
    strategy's (the last bits differ), while a name that sorts first is bitwise."""
    ours, theirs = fit_pair(_devices(8), "sequential", semantics="one_device")
    gaps = [float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True)]
    assert 0 < max(gaps) < 1e-4, gaps  # rounding apart, not a different step
    _assert_bitwise(fit_pair(_devices(8), "my_model", semantics="one_device"))


@pytest.mark.long
def test_twelve_towers_in_a_subprocess() -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.guard.test_mirrored_order", "12"],
                          capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {kind: True for kind in ("sequential", "subclassed", "Model")}, result


def _twelve(n: int) -> dict[str, bool]:
    devices = towers.simulate_devices(n, kind="cpu")
    pairs = {kind: fit_pair(devices, kind) for kind in ("sequential", "subclassed", "Model")}
    return {kind: all(np.array_equal(a, b) for a, b in zip(*pair, strict=True))
            for kind, pair in pairs.items()}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(_twelve(int(sys.argv[1]))), flush=True)
