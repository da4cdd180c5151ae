"""A Keras loss's ``reduction`` is honoured over the global batch
(towers.training.losses.REDUCTIONS).

Reference: the same model on one device, ``model.compile(loss=...)`` and one
``train_on_batch`` step of plain SGD on the whole batch. The towers split the batch of
10 over 4 towers as [3, 3, 3, 1] and add the towers' gradients; the reference adds
the 10 examples' gradient contributions inside its kernels. Both are sums of the same
per-example leaves ``c_e = ∂(w_e·l_e / D)/∂θ`` in different trees of depth ≤ B, so
:func:`towers.testing.sgd_step_bound` with those leaves and depth ``B + 2`` (the
product and the weighting inside each leaf round once more on each side) bounds the
difference. A reduction that is ignored (``"sum"`` trained as a mean) misses by a
factor of 10, far outside it.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.cluster.cross_worker import WorkerTrainer
from towers.testing import sgd_step_bound

LR = 0.05
BATCH = 10


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


def _batch(weighted: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(BATCH, 4)).astype(np.float32)
    y = rng.normal(size=(BATCH, 2)).astype(np.float32)
    w = rng.uniform(0.2, 2.0, size=BATCH).astype(np.float32) if weighted else None
    return x, y, w


def _divisor(reduction: str, w: np.ndarray | None) -> float:
    if reduction == "sum":
        return 1.0
    if reduction == "mean_with_sample_weight" and w is not None:
        return float(np.sum(w, dtype=np.float64))
    return float(BATCH)


def _leaves(model: keras.Model, batch: tuple, reduction: str) -> list[list[np.ndarray]]:
    """Each example's contribution ``∂(w_e·l_e / D)/∂θ`` to the reference's gradient."""
    x, y, w = batch
    divisor = _divisor(reduction, w)
    leaves = []
    for e in range(BATCH):
        with tf.GradientTape() as tape:
            pred = model(x[e : e + 1])
            per_ex = keras.losses.MeanSquaredError(reduction="none")(y[e : e + 1], pred)
            share = tf.reduce_sum(per_ex) * (1.0 if w is None else w[e]) / divisor
        leaves.append([g.numpy() for g in tape.gradient(share, model.trainable_variables)])
    return leaves


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight"]
)
@pytest.mark.parametrize("variables", ["parameter_device", "replicated"])
def test_reduction_equals_one_device_keras(reduction: str, weighted: bool, variables: str) -> None:
    batch = _batch(weighted)
    x, y, w = batch
    reference = _model()
    start = [v.numpy() for v in reference.trainable_variables]
    leaves = _leaves(reference, batch, reduction)
    reference.compile(keras.optimizers.SGD(LR), keras.losses.MeanSquaredError(reduction=reduction))
    want_loss = reference.train_on_batch(x, y, sample_weight=w)
    trainer = towers.TowerTrainer(
        _model(), keras.optimizers.SGD(LR), keras.losses.MeanSquaredError(reduction=reduction),
        devices=DEVICES[:4], all_reduce="naive", variables=variables,
    )  # fmt: skip
    loss = float(trainer.train_step(x, y, w))
    bound = sgd_step_bound(start, leaves, LR, depth=BATCH + 2)
    for got, want, tol in zip(trainer.model.trainable_variables, reference.trainable_variables,
                              bound):  # fmt: skip
        np.testing.assert_array_less(np.abs(got.numpy() - want.numpy()), tol + 1e-30)
    # the loss is reported under the same reduction (one value: a few roundings of B terms)
    np.testing.assert_allclose(loss, want_loss, rtol=(BATCH + 2) * 2.0**-23)
    ignored = [
        s - LR * sum(g[j] for g in leaves) * _divisor(reduction, w) / BATCH
        for j, s in enumerate(start)
    ]  # what training every reduction as a mean gives
    if reduction == "sum" or (reduction == "mean_with_sample_weight" and weighted):
        assert any(np.max(np.abs(v.numpy() - i)) > 10 * np.max(b) for v, i, b in
                   zip(trainer.model.trainable_variables, ignored, bound))  # fmt: skip


@pytest.mark.parametrize("reduction", ["none", None])
def test_an_unreduced_loss_trains_as_the_default(reduction: str | None) -> None:
    """``reduction="none"`` (the custom-loop loss) is per-example values over the global
    batch: bitwise the default reduction's step, on an uneven batch of 10 over 4 towers."""
    x, y, _ = _batch(False)
    runs = []
    for loss in (keras.losses.MeanSquaredError(reduction=reduction),
                 keras.losses.MeanSquaredError()):  # fmt: skip
        trainer = towers.TowerTrainer(_model(), keras.optimizers.SGD(LR), loss,
                                      devices=DEVICES[:4], all_reduce="naive")  # fmt: skip
        runs.append((float(trainer.train_step(x, y)), trainer.get_weights()))
    (loss_none, got), (loss_default, want) = runs
    assert loss_none == loss_default
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(a != s) for a, s in zip(got, [w.numpy() for w in _model().weights]))


def test_a_reduction_keras_would_not_know_is_refused_by_name() -> None:
    loss = keras.losses.MeanSquaredError()
    loss.reduction = "median"  # Keras' constructor refuses it; an attribute set later is not
    message = r"loss: MeanSquaredError has reduction='median', which towers does not support"
    with pytest.raises(ValueError, match=message + "; use one of sum_over_batch_size"):
        towers.TowerTrainer(_model(), keras.optimizers.SGD(LR), loss, devices=DEVICES[:2])


def test_mean_with_sample_weight_is_refused_across_workers() -> None:
    """One worker sees only its part of the sample weights (their global sum is the divisor)."""
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    with pytest.raises(ValueError, match=r"mean_with_sample_weight.*which one worker does not"):
        WorkerTrainer(_model(), keras.optimizers.SGD(LR), loss, devices=DEVICES[:2], num_workers=2)
    # a loss per output asking for it is refused the same way (a list of one, one output)
    with pytest.raises(ValueError, match=r"mean_with_sample_weight.*which one worker does not"):
        WorkerTrainer(_model(), keras.optimizers.SGD(LR), [loss], devices=DEVICES[:2],
                      num_workers=2)  # fmt: skip
