"""Every registered algorithm trains what tf.distribute trains (issue property 7).

Each algorithm sums the towers' gradients in its own order, so the comparison is per
step: both trainers start the step from the same weights, take one plain-SGD step
on the same batch, and must agree within ``towers.testing.sgd_step_bound`` — the
largest difference two summation orders of n terms can make (derived there), with
depth n − 1, which bounds every summation tree. The reference is MirroredStrategy
adding in tower order (ReductionToOneDevice), run as written. Sparse (Embedding)
gradients are gathered in tower order by every algorithm, exactly as the reference.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import towers
from reference import MirroredTrainer
from tests.conftest import DEVICES
from towers.allreduce import ALGORITHMS, as_written
from towers.testing import (
    ModelSpec,
    assert_weights_close,
    loss_fn,
    per_tower_gradients,
    sgd_step_bound,
)

LR = 0.1


@pytest.mark.long
@pytest.mark.parametrize("placement", ["parameter_device", "replicated"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_algorithm_trains_like_the_reference(name: str, placement: str) -> None:
    n = 4
    spec = ModelSpec("embedding" if placement == "replicated" else "regularized", seed=7)
    opt = lambda: keras.optimizers.SGD(LR)  # noqa: E731
    trainer = towers.TowerTrainer(
        spec.build, opt, loss_fn(), devices=DEVICES[:n], all_reduce=name, variables=placement
    )
    ref = MirroredTrainer(
        spec.build, opt, loss_fn(), DEVICES[:n], cross_device_ops="reduction_to_one_device"
    )
    for k, size in enumerate([11, 6]):  # 6 over 4 towers leaves the last tower empty
        start = trainer.get_weights()
        ref.set_weights(start)
        x, y = spec.batch(size, seed=k)
        grads = per_tower_gradients(trainer.model, x, y, DEVICES[:n])
        with as_written():  # both: towers' forward graph follows the caller's settings
            trainer.train_step(x, y)
            ref.train_step(x, y)
        bound = sgd_step_bound(start, grads, LR, depth=n - 1)
        assert_weights_close(
            trainer.get_weights(),
            ref.get_weights(),
            atol=bound,
            what=f"{name}/{placement} step {k}",
        )
    copies = trainer.replica_weights()
    for replica in copies[1:]:
        for a, b in zip(copies[0], replica):
            np.testing.assert_array_equal(a, b)
