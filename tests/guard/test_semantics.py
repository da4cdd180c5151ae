"""semantics: one device's result by default, MirroredStrategy's on request, each exactly.

``"mirrored"`` is what Keras 3 under MirroredStrategy observably does: tower 0's
non-trainable state (tests/test_step.py), each replica's loss divided by its own shard
size × replicas (the tf.distribute tutorial's ``compute_average_loss(per_example_loss)``)
and gradient clipping applied to each replica's share before the all-reduce. On the
uneven last batch (10 over 4 towers: 3+3+3+1) the tutorial's rule must equal the
tutorial's step within the derived SGD bound, and the default must not (measured: 68% of
the update on this batch, as ``examples/custom_loop_tutorial.py --show-global`` prints).
With a clipping optimizer, ``"mirrored"`` must equal ``reference.MirroredTrainer``
bitwise, and ``"one_device"`` one device.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from examples.custom_loop_tutorial import towers_step, tutorial_batches, your_step
from reference import MirroredTrainer
from tests.conftest import DEVICES
from towers.allreduce import as_written
from towers.guard.options import TowerOptions
from towers.guard.semantics import check_constant, check_semantics
from towers.testing import ModelSpec, compare, loss_fn
from towers.tower import tower_step

CLIPS = ({"clipnorm": 0.02}, {"global_clipnorm": 0.02}, {"clipvalue": 0.002})


@pytest.mark.parametrize("bad", [0, -2, float("inf"), "batch", "per_replica", True],
                         ids=["zero", "negative", "inf", "name", "per-replica",
                              "bool"])  # fmt: skip
def test_bad_denominators_are_refused_naming_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="loss_denominator"):
        TowerOptions.of("TowerTrainer", {"loss_denominator": bad})
    with pytest.raises(ValueError, match="semantics must be one of one_device, mirrored"):
        TowerOptions.of("TowerTrainer", {"semantics": "per_replica"})
    assert check_constant(64) == 64.0 and check_constant(None) is None


def test_a_reduction_without_a_batch_divisor_is_refused_naming_both() -> None:
    sgd = keras.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match=r"semantics='mirrored' with a loss of "
                                         r"reduction='sum' is refused"):  # fmt: skip
        check_semantics("mirrored", "per_replica", "sum", sgd)
    with pytest.raises(ValueError, match=r"loss_denominator=64.0 with a loss of reduction='mean_"):
        check_semantics("one_device", 64.0, "mean_with_sample_weight", sgd)
    check_semantics("mirrored", "global", "sum", sgd)  # the global batch: nothing replaced
    check_semantics("one_device", "global", "sum", sgd)
    rules = {(s, d): TowerOptions(semantics=s, loss_denominator=d).divisor
             for s in ("one_device", "mirrored") for d in (None, "global", 16)}
    assert rules == {("one_device", None): "global", ("mirrored", None): "per_replica",
                     ("one_device", "global"): "global", ("mirrored", "global"): "global",
                     ("one_device", 16): 16.0, ("mirrored", 16): 16.0}


def test_each_rule_gives_each_tower_its_divisor() -> None:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    model.set_weights([np.ones((2, 1), np.float32)])
    shard = (tf.constant([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), tf.zeros([3, 1]), None)
    values = tf.constant([1.0, 1.0, 2.0])  # the loss below, per example

    def loss_share(rule: str | float) -> float:
        result = tower_step(model, model.trainable_variables, [], shard,
                            loss_fn=lambda y, p: tf.reduce_sum(p, axis=-1),
                            global_batch=tf.constant(10), num_towers=4, device=DEVICES[0],
                            backward=False, divisor_rule=rule)  # fmt: skip
        return float(result.loss)

    for rule, divisor in (("global", 10), ("per_replica", 12), (64.0, 64), (2.5, 2.5)):
        if isinstance(divisor, int):  # as compute_average_loss takes a whole divisor
            want = tf.nn.compute_average_loss(values, global_batch_size=divisor)
        else:
            want = tf.reduce_sum(values) / divisor
        assert loss_share(rule) == float(want), rule  # 3 rows × 4 towers for per_replica


def test_mirrored_equals_the_tutorial_on_an_uneven_last_batch_and_one_device_does_not() -> None:
    devices = DEVICES[:4]
    last = tutorial_batches(1)  # the uneven batch of 10 alone: 3+3+3+1
    ported = compare(towers_step(devices, "sgd", "mirrored"), your_step(devices, "sgd"), last)
    assert ported.ok, str(ported)
    ours, theirs = towers_step(devices, "sgd", "one_device"), your_step(devices, "sgd")
    report = compare(ours, theirs, last)
    first = report.first
    assert first is not None and first.diff > 10 * first.bound  # a choice, not rounding
    start = ours.get_weights()
    theirs.set_weights(start)
    ours.train_step(*last[0]), theirs.train_step(*last[0])
    moved = max(np.abs(b - s).max() for b, s in zip(theirs.get_weights(), start))
    apart = max(np.abs(a - b).max() for a, b in zip(ours.get_weights(), theirs.get_weights()))
    assert 0.3 < apart / moved < 1.0  # measured 0.684: the one-example shard weighs 3×


def _batches(size: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    spec = ModelSpec("dense", seed=3)
    return [spec.batch(size, seed=k) for k in range(steps)]


def _trainer(clip: dict, n: int, semantics: str, **options: object) -> towers.TowerTrainer:
    return towers.TowerTrainer(ModelSpec("dense", seed=3).build,
                               lambda: keras.optimizers.SGD(0.5, **clip), loss_fn(),
                               devices=DEVICES[:n], all_reduce="naive", variables="replicated",
                               semantics=semantics, **options)  # fmt: skip


def _train(trainer: object, start: list[np.ndarray], batches: list) -> list[np.ndarray]:
    trainer.set_weights(start)  # type: ignore[attr-defined]
    with as_written():  # both sides as written: the same additions in the same order
        for x, y in batches:
            trainer.train_step(x, y)  # type: ignore[attr-defined]
    return trainer.get_weights()  # type: ignore[attr-defined]


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: next(iter(c)))
def test_mirrored_clips_each_towers_share_bitwise_as_mirrored_strategy(clip: dict) -> None:
    """Even batches (the two divisors agree) and, with the references' global divisor,
    uneven ones: bitwise ``MirroredTrainer`` (ReductionToOneDevice: tower order)."""
    n = 4
    for size, options in ((12, {}), (10, {"loss_denominator": "global"})):
        ours = _trainer(clip, n, "mirrored", **options)
        start = ours.get_weights()
        theirs = MirroredTrainer(
            ModelSpec("dense", seed=3).build, lambda c=clip: keras.optimizers.SGD(0.5, **c),
            loss_fn(), DEVICES[:n], cross_device_ops="reduction_to_one_device")
        batches = _batches(size, 2)
        for a, b in zip(_train(ours, start, batches), _train(theirs, start, batches), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: next(iter(c)))
def test_one_device_clips_the_reduced_gradient_as_one_device_does(clip: dict) -> None:
    """The default clips the sum: float32 roundings from one device, while clipping each
    share (MirroredStrategy's) moves the weights far more — so the test can tell them apart."""
    batches = _batches(12, 1)
    one = _trainer(clip, 1, "one_device")
    start = one.get_weights()
    alone = _train(one, start, batches)
    default = _train(_trainer(clip, 4, "one_device"), start, batches)
    mirrored = _train(_trainer(clip, 4, "mirrored"), start, batches)
    towers_gap = max(float(np.abs(a - b).max()) for a, b in zip(default, alone))
    mirrored_gap = max(float(np.abs(a - b).max()) for a, b in zip(mirrored, alone))
    assert towers_gap < 1e-6, towers_gap
    assert mirrored_gap > 1e-4, mirrored_gap


def test_mirrored_leaves_the_optimizers_clipping_in_place() -> None:
    """The apply runs unclipped while it is traced; the optimizer keeps its settings."""
    trainer = _trainer({"clipnorm": 0.02}, 2, "mirrored")
    trainer.train_step(*_batches(4, 1)[0])
    assert [r.optimizer.clipnorm for r in trainer.replicas] == [0.02, 0.02]
