"""Guides as tests, continued: transfer learning (freeze, then fine-tune) and
save/load/continue. The tolerance ``close`` and its derivation are in
tests/model/test_guides.py."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from tests.model.test_guides import SCE, _classes, _mlp, close, rng, towered

pytestmark = pytest.mark.long


def _transfer(semantics: str = "one_device"
              ) -> tuple[towers.TowerModel, keras.Model, list[np.ndarray], list[np.ndarray]]:
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
    tm = towered(build, semantics=semantics)
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


def test_transfer_learning_moving_statistics_equal_mirrored() -> None:
    """The same run: BatchNorm's moving statistics after fine-tuning. MirroredStrategy keeps
    each replica's own statistics and shows replica 0's; towers by default averages the
    towers' (one device's kind of value), and ``semantics="mirrored"`` keeps tower 0's —
    bitwise MirroredStrategy's, as docs/testing.md says."""
    tm, ref, _, _ = _transfer("mirrored")
    for i in (4, 5):
        np.testing.assert_array_equal(tm.get_weights()[i], ref.get_weights()[i],
                                      err_msg=f"weight {i}")
    default, _, _, _ = _transfer()
    assert not np.array_equal(default.get_weights()[4], ref.get_weights()[4])


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
