"""``BatchNormalization(synchronized=True)`` over towers normalizes with the global batch's
statistics (towers/training/synchronized.py): equal to MirroredStrategy and one device.

Every comparison is teacher-forced: each step starts the runs from the reference's
weights (moving statistics included), and each step's result is held to a bound.

- **Statistics exact** (:func:`_input_bn`, the layer on the inputs): inputs are multiples
  of 1/4 in [-2, 2] and global batches 1, 2, 4 or 8, so every sum of the statistics
  (Σx ≤ 64·2⁻², Σx² ≤ 32, the count) is exact in float32 in any order, and the
  divisions by a power of two too: mean and variance are the same floats in the towers,
  MirroredStrategy and one device (which computes ``Σ(x − mean)²/B``: exact as well).
  The runs then differ only in the order the gradients' sums add per-example terms:
  at most ``s − 1`` additions in a shard of ``s`` and ``n − 1`` in the all-reduce, so
  ``sgd_step_bound`` at depth ``B + n − 2`` over the per-example gradients (one tower per
  example gives them). A moving statistic is ``m·momentum + mean·(1 − momentum)``, the
  same float in every run; the towers average the copies of the ``k ≤ n`` towers that
  ran (``k`` equal values summed, then divided by ``k``): within ``γ_n`` relative.
- **Through the layer** (Dense → BN → Dense; Conv2D → BN → …): the statistics' and
  their gradients' all-reduces are TensorFlow's collective ring, as MirroredStrategy's
  (the same three tensors over the same group: the same sums, bitwise), so the towers'
  gradients equal its replicas'; the runs differ in the order the gradients are summed:
  ``sgd_step_bound`` at depth ``n − 1`` over the towers' gradients (as
  tests/guard/test_capabilities.py). The moving statistics tower 0 computes are its
  replica 0's bitwise (``semantics="mirrored"`` keeps tower 0's).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings
from hypothesis import strategies as st

import towers
from reference.mirrored import MirroredTrainer
from tests.conftest import DEVICES, examples
from towers.testing import sgd_step_bound
from towers.testing.bounds import gamma

LR = 0.1
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
Factory = Callable[[], keras.Model]


def _input_bn(seed: int = 0, synchronized: bool = True) -> keras.Model:
    """Input → BatchNormalization → Dense → Dense: the statistics are the inputs'."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.BatchNormalization(synchronized=synchronized, name="bn")(inputs)
    h = keras.layers.Dense(6, activation="relu", name="hidden")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def _dense_bn(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, name="hidden")(inputs)
    h = keras.layers.BatchNormalization(synchronized=True, name="bn")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def _conv_bn(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    h = keras.layers.BatchNormalization(synchronized=True, name="bn")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def _dyadic(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(-8, 9, size=(size, 5)).astype("float32") / 4
    return x, rng.integers(0, 3, size=size).astype("int32")


def _normal(size: int, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size, *shape)).astype("float32")
    return x, rng.integers(0, 3, size=size).astype("int32")


def _trainer(make: Factory, n: int, **options: object) -> towers.TowerTrainer:
    return towers.TowerTrainer(make, keras.optimizers.SGD(LR), LOSS, devices=DEVICES[:n],
                               **options)  # type: ignore[arg-type]


def _tower_gradients(trainer: towers.TowerTrainer, x: np.ndarray, y: np.ndarray
                     ) -> list[list[np.ndarray]]:  # fmt: skip
    """``grads[tower][var]`` of the trainer's own towers (synchronized: one graph, as the step)."""
    grads = tf.function(lambda a, b: trainer.forward_backward(trainer.split(a, b)).grads)(x, y)
    return [[np.asarray(g) for g in tower] for tower in grads]


def _trainable(model: keras.Model, weights: list[np.ndarray]) -> list[np.ndarray]:
    ids = {id(v) for v in model.trainable_variables}
    return [w for v, w in zip(model.weights, weights, strict=True) if id(v) in ids]


def _moving(model: keras.Model, weights: list[np.ndarray]) -> list[np.ndarray]:
    return [w for v, w in zip(model.weights, weights, strict=True) if "moving" in v.path]


def _assert_step(model: keras.Model, start: list[np.ndarray], got: list[np.ndarray],
                 want: list[np.ndarray], bound: list[np.ndarray], n: int) -> None:  # fmt: skip
    for j, (a, b, tol) in enumerate(zip(_trainable(model, got), _trainable(model, want),
                                        bound, strict=True)):  # fmt: skip
        err = np.abs(a.astype(np.float64) - b)
        assert np.all(err <= tol), f"weight {j}: max err {err.max():.3g} over {np.max(tol):.3g}"
    for a, b in zip(_moving(model, got), _moving(model, want), strict=True):
        np.testing.assert_allclose(a, b, rtol=gamma(n), atol=0)
    assert any(not np.array_equal(a, b) for a, b in zip(_trainable(model, got),
                                                        _trainable(model, start)))  # a step


@pytest.mark.long  # 22 s; test_statistics_are_mirroreds_bitwise is the fast suite's
@settings(max_examples=examples(ci=1))
@given(n=st.integers(1, 8), size=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 99))
@example(n=4, size=8, seed=0)  # 2, 2, 2, 2
@example(n=3, size=8, seed=1)  # 3, 3, 2
@example(n=8, size=4, seed=2)  # 1, 1, 1, 1 and four empty towers
def test_statistics_of_the_global_batch_equal_mirrored_and_one_device(n: int, size: int,
                                                                       seed: int) -> None:
    trainer, mirrored = _trainer(_input_bn, n), MirroredTrainer(
        _input_bn, keras.optimizers.SGD(LR), LOSS, DEVICES[:n])
    one = _trainer(lambda: _input_bn(synchronized=False), 1)
    leaves = _trainer(_input_bn, size)  # one tower per example: the per-example gradients
    for step in range(2):
        x, y = _dyadic(size, seed + step)
        start = mirrored.get_weights()
        for other in (trainer, one, leaves):
            other.set_weights(start)
        bound = sgd_step_bound(_trainable(trainer.model, start),
                               _tower_gradients(leaves, x, y), LR, depth=max(1, size + n - 2))
        for run in (trainer, mirrored, one):
            run.train_step(x, y)
        want = mirrored.get_weights()
        _assert_step(trainer.model, start, trainer.get_weights(), want, bound, n)
        _assert_step(trainer.model, start, one.get_weights(), want, bound, n)


@pytest.mark.parametrize(("make", "shape", "n", "size"), [
    pytest.param(_dense_bn, (5,), 4, 10, marks=pytest.mark.long),  # 3, 3, 3, 1
    pytest.param(_dense_bn, (5,), 3, 16, marks=pytest.mark.long),  # 6, 6, 4
    pytest.param(_dense_bn, (5,), 8, 5, marks=pytest.mark.long),  # 1 × 5, three empty towers
    pytest.param(_conv_bn, (6, 6, 2), 3, 8, marks=pytest.mark.long),  # 3, 3, 2
])  # fmt: skip
def test_gradients_through_the_statistics_equal_mirrored(make: Factory, shape: tuple[int, ...],
                                                         n: int, size: int) -> None:
    trainer, mirrored = _trainer(make, n), MirroredTrainer(
        make, keras.optimizers.SGD(LR), LOSS, DEVICES[:n])
    for step in range(3):
        x, y = _normal(size, shape, seed=step)
        start = mirrored.get_weights()
        trainer.set_weights(start)
        bound = sgd_step_bound(_trainable(trainer.model, start), _tower_gradients(trainer, x, y),
                               LR, depth=max(1, n - 1))  # fmt: skip
        trainer.train_step(x, y)
        mirrored.train_step(x, y)
        _assert_step(trainer.model, start, trainer.get_weights(), mirrored.get_weights(), bound, n)


@pytest.mark.parametrize(("make", "shape", "n", "size"), [
    (_dense_bn, (5,), 4, 10), (_dense_bn, (5,), 8, 5), (_conv_bn, (6, 6, 2), 3, 8)])
def test_statistics_are_mirroreds_bitwise(make: Factory, shape: tuple[int, ...], n: int,
                                          size: int) -> None:
    """The same three all-reduces over the same group as MirroredStrategy's replica context:
    from the same weights, tower 0's moving statistics (``semantics="mirrored"`` keeps
    them) are its replica 0's, bitwise."""
    trainer = _trainer(make, n, semantics="mirrored", loss_denominator="global")
    mirrored = MirroredTrainer(make, keras.optimizers.SGD(LR), LOSS, DEVICES[:n])
    trainer.set_weights(mirrored.get_weights())
    x, y = _normal(size, shape, seed=7)
    trainer.train_step(x, y)
    mirrored.train_step(x, y)
    for got, want in zip(_moving(trainer.model, trainer.get_weights()),
                         _moving(trainer.model, mirrored.get_weights()), strict=True):
        np.testing.assert_array_equal(got, want)


def test_not_synchronized_keeps_each_towers_statistics() -> None:
    """``synchronized=False``: each tower normalizes its own shard, and the moving mean is
    the towers' average of their own updates (exact inputs: within ``γ_4``)."""
    x, y = _dyadic(8, seed=3)  # shards of 3, 3, 2
    trainer = _trainer(lambda: _input_bn(synchronized=False), 3)
    assert trainer.synchronized == []
    trainer.train_step(x, y)
    momentum = trainer.model.get_layer("bn").momentum
    shards = (x[:3], x[3:6], x[6:])
    per_tower = np.mean([s.mean(axis=0) * (1 - momentum) for s in shards], axis=0)
    moving_mean = trainer.model.get_layer("bn").moving_mean.numpy()
    np.testing.assert_allclose(moving_mean, per_tower, rtol=gamma(4), atol=0)
    assert not np.allclose(moving_mean, x.mean(axis=0) * (1 - momentum))


@pytest.mark.parametrize("variables", [
    "replicated", pytest.param("sharded", marks=pytest.mark.long), "parameter_device"])
def test_fit_takes_the_global_batch_statistics(variables: str) -> None:
    """``TowerModel.fit`` (8 over 4 towers: the relaxed trace; a last batch of 2: 1, 1 and
    two empty towers, the static trace) moves the moving statistics by the global batches'
    (exact: ``m_t = m_{t−1}·μ + s_t·(1 − μ)``, a few roundings, within ``γ_8``); each
    tower's own would give the last batch a variance of 0."""
    x, y = _dyadic(10, seed=5)
    tm = towers.TowerModel(_input_bn(), devices=DEVICES[:4], variables=variables)
    tm.compile(keras.optimizers.SGD(LR), LOSS)
    tm.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    bn = tm.trainer.model.get_layer("bn")
    mean, variance = np.zeros(5), np.ones(5)
    for batch in (x[:8], x[8:]):
        mean = mean * bn.momentum + batch.mean(axis=0) * (1 - bn.momentum)
        variance = variance * bn.momentum + batch.var(axis=0) * (1 - bn.momentum)
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=gamma(8), atol=1e-12)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variance, rtol=gamma(8), atol=0)
    np.testing.assert_array_equal(tm.predict(x[:3], verbose=0).shape, (3, 3))


@pytest.mark.long  # 10 s
def test_the_relaxed_trace_equals_the_static_one() -> None:
    """``TowerModel.fit``'s trace with the batch dimension unknown (one trace for 7 and 10
    examples over 4 towers: 2, 2, 2, 1 and 3, 3, 3, 1) meets over every tower as the
    static trace does."""
    relaxed, static = _trainer(_input_bn, 4), _trainer(_input_bn, 4)
    for size in (7, 10):
        x, y = _dyadic(size, seed=size)
        start = static.get_weights()
        relaxed.set_weights(start)
        leaves = _trainer(_input_bn, size)
        leaves.set_weights(start)
        bound = sgd_step_bound(_trainable(static.model, start), _tower_gradients(leaves, x, y),
                               LR, depth=size + 2)  # fmt: skip
        relaxed.train_step_as_keras(x, y, None, batch_unknown=True)
        static.train_step(x, y)
        _assert_step(static.model, start, relaxed.get_weights(), static.get_weights(), bound, 4)
    assert len(relaxed.compiled.relaxed._traced) == 1  # one trace served both sizes


def test_phases_that_cannot_meet_are_refused() -> None:
    """One tower alone, or the towers eagerly (each collective would wait for peers that
    do not exist yet); in a tf.function, the phases give the step's gradients."""
    trainer = _trainer(_input_bn, 2)
    shards = trainer.split(*_dyadic(4, seed=0))
    with pytest.raises(ValueError, match=r"tower_step: .*\['bn'\].*call forward_backward"):
        trainer.tower_step(shards, 0)
    with pytest.raises(ValueError, match=r"forward_backward ran eagerly: .*\['bn'\].*tf\.function"):
        trainer.forward_backward(shards)
    one = _trainer(_input_bn, 1)
    assert len(one.forward_backward(one.split(*_dyadic(4, seed=0))).towers) == 1


def test_refused_across_a_worker_and_under_xla() -> None:
    from towers.cluster import WorkerTrainer

    with pytest.raises(ValueError, match=r"\['bn'\] are BatchNormalization\(synchronized=True\)"
                                         r": trainer='WorkerTrainer' with batch_norm"):
        WorkerTrainer(_input_bn, keras.optimizers.SGD(LR), LOSS, devices=DEVICES[:2],
                      num_workers=1)  # fmt: skip
    with pytest.raises(ValueError, match="batch_norm='synchronized' with jit_compile='on'"):
        _trainer(_input_bn, 2, jit_compile=True)
    _trainer(_input_bn, 1, jit_compile=True)  # one tower: its statistics are the batch's


def test_a_keras_without_the_function_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import keras.src.backend.tensorflow.nn as keras_nn

    trainer = _trainer(_input_bn, 2)
    monkeypatch.delattr(keras_nn, "_compute_moments_sync")
    with pytest.raises(RuntimeError, match=r"has no keras\.src\.backend\.tensorflow\.nn\."
                                           r"_compute_moments_sync.*synchronized=False"):
        trainer.train_step(*_dyadic(4, seed=0))
