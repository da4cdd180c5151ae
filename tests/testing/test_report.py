"""A comparison that fails says why it may have: each cause it can read, and no other.

Every detectable cause is planted in a real comparison that fails for that reason and
must be named in the report; a planted bug on an even batch without clipping or
BatchNorm must name none of them. The readers themselves are checked on plain sides.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import keras
import pytest
import tensorflow as tf

from reference import MirroredTrainer
from tests.conftest import DEVICES
from tests.testing.test_compare import towers_step, users_step
from tests.testing.test_invariance import LOSS, DropsATower, batches, sgd, tiny_mlp
from towers import TowerTrainer
from towers.testing import BisectReport, as_step, compare
from towers.testing.report import MIRRORED_SETTING, possible_causes

UNEVEN = batches(1, 12) + batches(1, 10)  # the second splits 3+3+3+1 over 4 towers


def _first(report: BisectReport) -> Any:
    assert report.first is not None, str(report)
    return report.first


def _named(report: BisectReport) -> list[str]:
    return [cause.split(":")[0] for cause in _first(report).causes]


def test_an_uneven_batch_with_different_divisors_is_named_with_both() -> None:
    ours = towers_step(4, semantics="mirrored")
    report = compare(ours, MirroredTrainer(tiny_mlp, sgd, LOSS, DEVICES[:4]), UNEVEN)
    first = _first(report)
    assert first.step == 2 and _named(report) == ["uneven batch"], str(report)
    assert first.causes[0].startswith("uneven batch: step 2's batch of 10 splits 3+3+3+1 over "
                                      "4 towers and is shorter than the largest batch (12)")
    assert "by 12, 12, 12, 4 (shard × replicas); B by 10 (the global batch)" in first.causes[0]
    assert first.setting == ""  # the towers side already divides as MirroredStrategy's loops do
    assert "possible causes" in str(report) and "uneven batch: step 2" in str(report)


def test_gradient_clipping_on_either_side_is_named() -> None:
    clipped = lambda: keras.optimizers.SGD(0.1, clipnorm=1e-3)  # noqa: E731
    report = compare(towers_step(2, clipped), MirroredTrainer(tiny_mlp, clipped, LOSS, DEVICES[:2]),
                     batches(1))  # fmt: skip
    assert _named(report) == ["gradient clipping"], str(report)
    assert "A's optimizer has clipnorm=0.001; B's optimizer has clipnorm=0.001" in str(report)
    assert "clips each replica's share before the all-reduce" in _first(report).causes[0]


def bn_mlp() -> keras.Model:
    """5 → 6 → BatchNorm → tanh → 3."""
    inp = keras.Input((5,))
    init = keras.initializers.GlorotUniform
    h = keras.layers.Dense(6, kernel_initializer=init(1), name="dense")(inp)
    h = keras.layers.Activation("tanh")(keras.layers.BatchNormalization(name="bn")(h))
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer=init(2), name="dense_1")(h))


def one_device(model_fn: Any) -> Any:
    """A user's one-device step: the mean loss over the whole batch."""
    model, optimizer = model_fn(), sgd()

    @tf.function
    def step(batch: Any) -> tf.Tensor:
        x, y = batch
        with tf.GradientTape() as tape:
            per_example = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                                        True)  # fmt: skip
            loss = tf.reduce_mean(per_example)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return as_step(step, model, optimizer=optimizer, loss=LOSS)


def test_batch_norm_is_named_against_a_step_that_normalizes_the_whole_batch() -> None:
    ours = TowerTrainer(bn_mlp, sgd, LOSS, devices=DEVICES[:2], all_reduce="ring",
                        variables="replicated")  # fmt: skip
    report = compare(ours, one_device(bn_mlp), batches(1))
    assert _named(report) == ["BatchNormalization (bn)"], str(report)
    assert _first(report).setting == ""  # one device is not MirroredStrategy's semantics


def test_a_difference_of_a_few_ulps_names_the_reduction_order() -> None:
    report = compare(towers_step(3), MirroredTrainer(tiny_mlp, sgd, LOSS, DEVICES[:3]),
                     batches(2), bound=0.0)  # fmt: skip
    assert _named(report) == ["reduction order"], str(report)
    assert " ULP of the value" in _first(report).causes[0]


def test_a_planted_bug_on_an_even_batch_names_no_cause() -> None:
    report = compare(towers_step(1), users_step(weighting=2.0), batches(2), towers=1)
    first = _first(report)
    assert first.step == 1 and first.causes == () and first.setting == ""
    assert "possible causes" not in str(report) and "setting" not in str(report)


def test_a_planted_bug_on_an_uneven_batch_with_equal_divisors_names_no_cause() -> None:
    """Both sides divide by the global batch: the uneven step is not a cause."""
    dropping = TowerTrainer(tiny_mlp, sgd, LOSS, devices=DEVICES[:4], variables="replicated",
                            all_reduce=DropsATower(step=2), check_algorithm=False)  # fmt: skip
    report = compare(MirroredTrainer(tiny_mlp, sgd, LOSS, DEVICES[:4]), dropping, UNEVEN)
    assert _first(report).step == 2 and _first(report).causes == (), str(report)


def side(**attributes: Any) -> SimpleNamespace:
    return SimpleNamespace(**attributes)


def causes(a: Any, b: Any, sizes: list[int], step: int, towers: int, diff: float = 1.0,
           value: float = 1.0) -> tuple[tuple[str, ...], str]:  # fmt: skip
    return possible_causes(a, b, sizes, step=step, towers=towers, diff=diff, value=value,
                           dtype="float32")  # fmt: skip


def test_the_readers_on_plain_sides() -> None:
    plain, unknown = side(loss_denominator="global"), side()
    assert causes(plain, plain, [64, 10], 2, 4) == ((), "")  # divisors declared equal
    assert causes(side(loss_denominator=64), side(loss_denominator=64.0), [64, 8], 2, 4)[0] == ()
    (short,), _ = causes(plain, unknown, [64, 8], 2, 1)  # one tower: short, not split
    assert short.startswith("uneven batch: step 2's batch of 8 is shorter than the largest "
                            "batch (64)") and "does not declare" in short  # fmt: skip
    assert causes(plain, unknown, [64, 64], 2, 4)[0] == ()  # an even batch
    clip = side(optimizer=keras.optimizers.SGD(clipvalue=0.5))
    assert causes(clip, clip, [8], 1, 2)[0] == ()  # both clip alike, on one device
    (named,), _ = causes(side(optimizer=sgd()), clip, [8], 1, 2)
    assert named.startswith("gradient clipping: B's optimizer has clipvalue=0.5")


@pytest.mark.parametrize(("ulps", "named"), [(1.0, True), (8.0, True), (9.0, False)])
def test_the_reduction_order_within_a_few_ulps(ulps: float, named: bool) -> None:
    spacing = 2.0**-23  # of 1.0 in float32
    found, _ = causes(side(), side(), [8], 1, 2, diff=ulps * spacing, value=1.0)
    assert bool(found) == named and all(c.startswith("reduction order") for c in found)


def test_the_setting_is_named_beside_mirrored_semantics() -> None:
    mirrored = side(strategy=SimpleNamespace(num_replicas_in_sync=4))
    ours = towers_step(4)
    found, setting = causes(ours, mirrored, [64, 10], 2, 4)
    assert [c.split(":")[0] for c in found] == ["uneven batch"] and setting == MIRRORED_SETTING
    assert 'semantics="mirrored"' in setting
