"""The guard's fused check: a finite sum proves every element finite; on an overflowed
sum the elementwise pass decides, so finite values whose sum overflows are not flagged."""

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES, examples
from towers.allreduce import Algorithm, naive
from towers.allreduce.codecs import topk
from towers.allreduce.machinery.registry import Configured
from towers.guard import capabilities
from towers.guard.capabilities import COLLECTIVE_OPS
from towers.guard.nonfinite import _all_finite, sums_exactly, tower_code

BIG = np.float32(3e38)  # two of them overflow float32's sum


@pytest.mark.parametrize(
    "values, finite",
    [
        pytest.param([[1.0, 2.0], [3.0]], True, id="finite"),
        pytest.param([[BIG, BIG], [BIG]], True, id="sum-overflows-elements-finite"),
        pytest.param([[BIG], [-BIG, BIG, BIG]], True, id="partial-sums-overflow"),
        pytest.param([[1.0, np.inf], [2.0]], False, id="inf"),
        pytest.param([[np.inf], [-np.inf]], False, id="inf-minus-inf-across-values"),
        pytest.param([[1.0], [np.nan, 1.0]], False, id="nan"),
        pytest.param([[BIG, BIG], [np.nan]], False, id="overflow-and-nan"),
        pytest.param([[-BIG, -BIG, np.inf]], False, id="inf-after-negative-overflow"),
        pytest.param([], True, id="no-values"),
    ],
)
def test_all_finite_is_exact(values, finite):
    tensors = [tf.constant(v, tf.float32) for v in values]
    assert bool(_all_finite(tensors)) is finite
    assert bool(tf.function(_all_finite)(tensors)) is finite


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"], ids=str)
def test_all_finite_other_dtypes(dtype):
    big = tf.constant([6e4, 6e4] if dtype == "float16" else [1e38, 3e38], dtype)
    assert bool(_all_finite([big, big]))  # the sum overflows (float16, and float32's total)
    assert not bool(_all_finite([big, tf.constant([np.nan], dtype)]))


def test_tower_code_bits_and_sparse_values():
    nan_slices = tf.IndexedSlices(tf.constant([[np.nan]]), tf.constant([0]), tf.constant([2, 1]))
    code = tower_code(tf.constant(np.inf), [tf.constant([BIG, BIG]), nan_slices],
                      [tf.constant([1.0]), tf.constant([7], tf.int64)])
    assert int(code) == 1 + 2
    assert int(tower_code(tf.constant(1.0), [tf.constant([BIG, BIG])],
                          [tf.constant([-np.inf])])) == 4


# --- the fast path over the reduced gradients (an exact all-reduce, one process) ------------

OWN = [name for name in towers.allreduce.ALGORITHMS if name not in COLLECTIVE_OPS]
"""The registry's algorithms built on copies: each sums exactly, so the guard checks one
copy of the reduced gradients instead of every tower's."""


def test_sums_exactly_names_the_library_sums_only() -> None:
    for name in OWN:
        assert sums_exactly(towers.allreduce.get(name), "replicated"), name
    assert sums_exactly("anything", "sharded")  # the placement's own ring reduce-scatter
    for name in COLLECTIVE_OPS:
        assert not sums_exactly(towers.allreduce.get(name), "replicated"), name
    assert not sums_exactly(lambda values, op="sum": list(values), "replicated")
    # a user's registered algorithm has a record, but the library has not proved it sums
    mine = Configured(Algorithm("mine", lambda: naive), run=naive)
    assert capabilities.algorithm_kind(mine) == "registered"
    assert not sums_exactly(mine, "replicated")
    # a library algorithm made of parts is exact only when every part is
    assert sums_exactly(towers.allreduce.hierarchical("naive", "tree"), "replicated")
    assert not sums_exactly(towers.allreduce.hierarchical(naive_user, "ring"), "replicated")
    assert not sums_exactly(towers.allreduce.hierarchical("naive", mine), "replicated")
    assert not sums_exactly(towers.bucketed("naive", 1024), "replicated")
    assert not sums_exactly(towers.compressed("ring", topk(0.5)), "replicated")


def naive_user(values: Any, op: str = "sum") -> Any:
    """A user's callable (no record): the library has not proved it sums."""
    return naive(values, op=op)


class _PoisonGradient(keras.layers.Layer):
    """``h`` forward; backward multiplies the gradient reaching ``h`` from every example
    whose first input is 7 by ``value`` (-7: by ``-value``): the loss stays finite, the
    gradients of the layers below do not."""

    def __init__(self, value: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value = value

    def call(self, h: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
        sign = tf.where(tf.equal(tf.abs(x[:, :1]), 7.0), tf.sign(x[:, :1]), 0.0)

        @tf.custom_gradient
        def identity(h: tf.Tensor) -> Any:
            return tf.identity(h), lambda dy: tf.where(sign != 0, dy * sign * self.value, dy)

        return identity(h)


def _poisoned_model(value: float) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(_PoisonGradient(value)(hidden, inputs)))


def _state(trainer: towers.TowerTrainer) -> list[bytes]:
    return [np.asarray(v.numpy()).tobytes() for r in trainer.replicas
            for v in [*r.model.variables, *r.optimizer.variables]]


@given(
    algorithm=st.sampled_from(OWN),
    n=st.integers(1, 8),
    data=st.data(),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    variables=st.sampled_from(["parameter_device", "replicated"]),
)
@settings(max_examples=examples(ci=6))
@example(algorithm="ring", n=3, data=None, value=np.inf, variables="sharded")
@example(algorithm="naive", n=8, data=None, value=np.nan, variables="parameter_device")
def test_a_gradient_alone_nonfinite_skips_through_the_reduced_check(
    algorithm: str, n: int, data: Any, value: float, variables: str
) -> None:
    # The loss is finite on every tower: only the (reduced) gradients can give it away.
    bad = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2, unique=True)) \
        if data is not None else [n - 1]
    trainer = towers.TowerTrainer(
        lambda: _poisoned_model(value), keras.optimizers.Adam(0.01), "mse",
        devices=DEVICES[:n], all_reduce=algorithm, variables=variables)  # fmt: skip
    assert trainer._reduce_first
    x = np.linspace(-1, 1, 2 * n * 3, dtype="float32").reshape(2 * n, 3)
    y = np.zeros([2 * n, 2], "float32")
    for k, tower in enumerate(bad):  # Inf on one tower and -Inf on another: NaN when summed
        x[2 * tower, 0] = -7.0 if k else 7.0
    before = _state(trainer)
    assert np.isfinite(float(trainer.train_step(x, y)))  # the loss could not tell
    assert _state(trainer) == before
    assert trainer.skipped_steps == 1
    assert trainer.last_step_nonfinite == {t: ["gradients"] for t in sorted(bad)}
    x[:, 0] = np.where(np.abs(x[:, 0]) == 7.0, 0.5, x[:, 0])
    trainer.train_step(x, y)  # a finite step still applies
    assert _state(trainer) != before and trainer.skipped_steps == 1
