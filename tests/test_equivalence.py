"""The central property: towers trains exactly what tf.distribute trains.

Both sides run :func:`towers.allreduce.ordering.as_written` (Grappler's arithmetic rewrites off):
Grappler reorders additions differently in the two graphs (measured: 2 ULPs at 6 towers,
and it absorbed the reference's replica-0 gradient ``AddN`` into its reduction), so
"the same order" is only meaningful for graphs run as written.

1. Same summation order -> bitwise. ``naive`` and ``parameter_device`` add the towers'
   gradients left to right in tower order, as ``ReductionToOneDevice`` (``add_n`` on one
   device) does inside MirroredStrategy and CentralStorageStrategy. The split, the
   per-tower loss (``compute_average_loss`` + ``scale_regularization_loss``), the kernels
   and the optimizer arithmetic are the same operations on the same values, so every
   weight must come out bitwise equal — tolerance 0 — over 1–3 steps, all model
   families, all optimizers, both placements, uneven and tiny batches.
2. Different summation order -> bounded. MirroredStrategy's default on CPUs
   (CollectiveAllReduce, a ring) adds in another order. Plain SGD steps from equal
   weights differ by at most ``towers.testing.sgd_step_bound`` (derived there).
"""

from __future__ import annotations

import keras
from hypothesis import given, note, settings
from hypothesis import strategies as st

import towers
from reference import CentralStorageTrainer, MirroredTrainer, ReferenceUnavailable
from tests.conftest import DEVICES
from towers.allreduce.ordering import as_written
from towers.testing import (
    OPTIMIZERS,
    ModelSpec,
    TrainingCase,
    assert_weights_close,
    loss_fn,
    no_empty_shards,
    per_tower_gradients,
    sgd_step_bound,
    training_cases,
)


def _reference(case: TrainingCase) -> MirroredTrainer | CentralStorageTrainer:
    args = (case.spec.build, OPTIMIZERS[case.optimizer], loss_fn(), DEVICES[: case.towers])
    if case.placement == "parameter_device":
        try:
            return CentralStorageTrainer(*args)
        except ReferenceUnavailable as why:
            # Same summation order (add_n on device 0), so the comparison stays exact.
            note(f"CentralStorageStrategy cannot run this case ({why}); using MirroredStrategy")
    return MirroredTrainer(*args, cross_device_ops="reduction_to_one_device")


@settings(max_examples=12)
@given(case=training_cases(), algorithm=st.sampled_from(["naive", "parameter_device"]))
def test_same_order_is_bitwise_equal(case: TrainingCase, algorithm: str) -> None:
    trainer = towers.TowerTrainer(
        case.spec.build,
        OPTIMIZERS[case.optimizer],
        loss_fn(),
        devices=DEVICES[: case.towers],
        all_reduce=algorithm,
        variables=case.placement,
        non_trainable="first_tower",
    )
    try:
        ref = _reference(case)
        ref.set_weights(trainer.get_weights())
        for x, y in case.batches():
            ours = trainer.train_step(x, y)
            with as_written():
                theirs = ref.train_step(x, y)
    except ReferenceUnavailable as why:
        note(f"no reference: {why}")
        return
    assert_weights_close(trainer.get_weights(), ref.get_weights(), atol=0.0, what=str(case))
    assert float(ours) == float(theirs)


@settings(max_examples=6)
@given(
    family=st.sampled_from(["dense", "conv", "embedding", "regularized"]),
    n=st.integers(2, 8),
    sizes=st.lists(st.integers(8, 24), min_size=1, max_size=3),
    placement=st.sampled_from(["parameter_device", "replicated"]),
)
def test_default_mirrored_within_summation_bound(
    family: str, n: int, sizes: list[int], placement: str
) -> None:
    lr = 0.1
    spec = ModelSpec(family, seed=n)
    opt = lambda: keras.optimizers.SGD(lr)  # noqa: E731
    trainer = towers.TowerTrainer(
        spec.build, opt, loss_fn(), devices=DEVICES[:n], all_reduce="naive", variables=placement
    )
    ref = MirroredTrainer(spec.build, opt, loss_fn(), DEVICES[:n])  # CollectiveAllReduce
    for k, size in enumerate(sizes):
        start = trainer.get_weights()
        ref.set_weights(start)
        x, y = spec.batch(no_empty_shards(size, n), seed=k)
        grads = per_tower_gradients(trainer.model, x, y, DEVICES[:n])
        trainer.train_step(x, y)
        ref.train_step(x, y)
        bound = sgd_step_bound(start, grads, lr, depth=n - 1)
        assert_weights_close(
            trainer.get_weights(),
            ref.get_weights(),
            atol=bound,
            what=f"{family}, {n} towers, step {k}",
        )
