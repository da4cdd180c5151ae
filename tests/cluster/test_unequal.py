"""Unequal worker batches: 2 workers × 2 towers equal the single-process 4-tower trainer.

The global batches (61, 7, 1, 33, 64) are cut over the workers first, then over each
worker's towers, by MirroredStrategy's rule (61 → 31 + 30 → 16 + 15 | 15 + 15; 1 → 1 | 0:
worker 1 has no example); ``WorkerTrainer`` all-reduces the local counts, so every tower
divides by the global batch. The single-process trainer on 4 towers cuts the same batch
flat (61 → 16, 15, 15, 15) and sums in another order.

The bound, per step, from the same weights: both gradients are sums of the same
per-example gradients g_e (each example's forward and backward run row by row, the
same in both), in two different trees over B leaves, each of depth ≤ B − 1, so
``towers.testing.bounds.sgd_step_bound`` with the per-example gradients as its "towers"
and depth B − 1 holds each weight's difference after the step.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.cluster.conftest import BATCHES, LR, TOWERS, WORKERS, Run
from tests.cluster.train_worker import make_model
from tests.conftest import DEVICES
from towers.cluster.cross_worker import worker_slice
from towers.testing.bounds import sgd_step_bound
from towers.training.data import digits

pytestmark = pytest.mark.long  # a long proof: python -m pytest -m long

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def _per_example_grads(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list[list[np.ndarray]]:
    """``grads[example][var]`` of (example's loss) / B."""
    @tf.function
    def grad(x_e: tf.Tensor, y_e: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = LOSS.call(y_e, model(x_e, training=True)) / len(x)
        return tape.gradient(loss, model.trainable_variables)

    return [[g.numpy() for g in grad(x[e:e + 1], y[e:e + 1])] for e in range(len(x))]


def test_worker_parts_follow_mirrored_strategys_split() -> None:
    assert [worker_slice(61, 2, k) for k in (0, 1)] == [slice(0, 31), slice(31, 61)]
    assert [worker_slice(1, 2, k) for k in (0, 1)] == [slice(0, 1), slice(1, 1)]


def test_every_step_matches_the_single_process_trainer(straight_run: tuple[Run, Path]) -> None:
    run, out = straight_run
    local = run.lines("STEP")
    assert [int(f[1]) for f in local[1]] == [30, 3, 0, 16, 32]  # worker 1's parts, one empty
    x, y, _, _ = digits()
    offsets = np.cumsum([0, *BATCHES])
    ref = towers.TowerTrainer(make_model, keras.optimizers.SGD(LR), LOSS,
                              devices=DEVICES[:WORKERS * TOWERS], all_reduce="ring",
                              variables="replicated")
    probe = make_model()
    before = _weights(out / "init0.npz")
    for step, batch in enumerate(BATCHES):
        after = _weights(out / f"w0_{step}.npz")
        for a, b in zip(after, _weights(out / f"w1_{step}.npz"), strict=True):
            np.testing.assert_array_equal(a, b)  # both workers hold the same bits
        xb, yb = x[offsets[step]:offsets[step + 1]], y[offsets[step]:offsets[step + 1]]
        ref.set_weights(before)
        ref.train_step(xb, yb)
        probe.set_weights(before)
        bound = sgd_step_bound(before, _per_example_grads(probe, xb, yb), LR, depth=batch - 1)
        for j, (mine, theirs, tol) in enumerate(zip(after, ref.get_weights(), bound, strict=True)):
            err = np.abs(mine.astype(np.float64) - theirs)
            assert np.all(err <= tol), f"step {step} weight {j}: {err.max()} > {tol[err > tol]}"
        assert not all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))
        before = after
