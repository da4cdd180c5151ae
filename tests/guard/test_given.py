"""Layers a trainer cannot run as written are refused by name when it is built
(towers/guard/given.py): ``BatchNormalization(synchronized=True)`` over more than one
tower where the capability table refuses it, and ``variables="sharded"`` with an
Embedding and an optimizer whose sparse and dense updates differ — measured for every
Keras optimizer, not listed.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES
from tests.model.helpers import LOSS, data
from tests.strategies import OPTIMIZERS as STEP_OPTIMIZERS
from towers.guard.given import sparse_equals_dense

X, Y = data(24, seed=2)


def _synced(nested: bool, seed: int = 0) -> keras.Model:
    """Dense -> BatchNormalization(synchronized=True) -> Dense (optionally in a sub-model)."""
    keras.utils.set_random_seed(seed)
    bn = keras.layers.BatchNormalization(synchronized=True, name="synced_bn")
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    if nested:
        inner_in = keras.Input((8,))
        h = keras.Model(inner_in, bn(inner_in), name="block")(h)
    else:
        h = bn(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_synchronized_batchnorm_is_refused_where_it_cannot_meet(n: int, nested: bool) -> None:
    """Honoured over towers (tests/training/test_synchronized.py), found in a sub-model too;
    refused by name under XLA, where the towers' collectives do not run."""
    tm = towers.TowerModel(_synced(nested), devices=DEVICES[:n], variables="replicated")
    tm.compile(keras.optimizers.SGD(0.1), LOSS)
    assert tm.trainer.synchronized == ["synced_bn"]
    with pytest.raises(ValueError, match=r"\['synced_bn'\] are BatchNormalization\(synchronized="
                                         r"True\): batch_norm='synchronized' with jit_compile"):
        towers.TowerTrainer(_synced(nested), keras.optimizers.SGD(0.1), LOSS,
                            devices=DEVICES[:n], jit_compile=True)  # fmt: skip


def test_synchronized_batchnorm_at_one_tower_equals_one_device() -> None:
    tm = towers.TowerModel(_synced(True, seed=4), devices=DEVICES[:1], variables="replicated")
    tm.compile(keras.optimizers.SGD(0.1), LOSS)
    plain = _synced(True, seed=4)
    plain.compile(keras.optimizers.SGD(0.1), LOSS)
    for model in (tm, plain):
        model.fit(X, Y, batch_size=8, shuffle=False, verbose=0)
    for got, want in zip(tm.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


OPTIMIZERS: dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    **STEP_OPTIMIZERS,  # sgd, momentum, adam, nadam, rmsprop; and every other built-in one:
    "adamw": lambda: keras.optimizers.AdamW(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "lion": lambda: keras.optimizers.Lion(0.001),
}


def _embedding(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(6, 3, name="words")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def _tokens(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)  # 6 words in 4 slots: rows repeat within a batch
    return rng.integers(0, 6, size=(n, 4)).astype("int32"), rng.integers(0, 3, size=n)


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_embedding_is_refused_exactly_where_sparse_and_dense_differ(name: str) -> None:
    differ = not sparse_equals_dense(OPTIMIZERS[name]())
    sharded = towers.TowerModel(_embedding(), devices=DEVICES[:3], variables="sharded")
    if differ:
        with pytest.raises(ValueError, match=r"variables='sharded'.*\['words'\].*Embedding.*"
                                             rf"optimizer {type(OPTIMIZERS[name]()).__name__}"):
            sharded.compile(OPTIMIZERS[name](), LOSS)
        # asked for explicitly, the dense update is the user's choice
        towers.TowerModel(_embedding(), devices=DEVICES[:3], variables="sharded",
                          sparse="densify").compile(OPTIMIZERS[name](), LOSS)  # fmt: skip
        return
    sharded.compile(OPTIMIZERS[name](), LOSS)
    # the reference: the same dense update of the summed rows (with sparse="gather",
    # SGD adds a repeated row's updates one by one: the same rule, other rounding)
    replicated = towers.TowerModel(_embedding(), devices=DEVICES[:3], variables="replicated",
                                   all_reduce="ring", sparse="densify")  # fmt: skip
    replicated.compile(OPTIMIZERS[name](), LOSS)
    x, y = _tokens(24, seed=1)
    for model in (sharded, replicated):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for got, want in zip(sharded.get_weights(), replicated.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_accepted_optimizers_are_the_ones_whose_rule_ignores_repeats() -> None:
    accepted = {name for name, make in OPTIMIZERS.items() if sparse_equals_dense(make())}
    assert {"sgd", "momentum", "lion"} <= accepted
    assert not accepted & {"adam", "adamw", "nadam", "rmsprop", "adagrad"}
