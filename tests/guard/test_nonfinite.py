"""The guard's fused check: a finite sum proves every element finite; on an overflowed
sum the elementwise pass decides, so finite values whose sum overflows are not flagged."""

from typing import Any, NamedTuple

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
from towers.devices import canonical_device
from towers.guard import capabilities
from towers.guard.capabilities import COLLECTIVE_OPS, sums_exactly
from towers.guard.nonfinite import gather_codes, tower_code, tower_sum
from towers.split import batch_tensors

BIG = np.float32(3e38)  # two of them overflow float32's sum


class _Tower(NamedTuple):
    loss: tf.Tensor
    grads: list[tf.Tensor]
    non_trainable: list[tf.Tensor]


def _codes(values: list[list[float]], *, reduced: bool, traced: bool) -> list[int]:
    """:func:`gather_codes` over two towers: tower 1's gradients are ``values`` (tower 0's
    are zeros of the same shapes); ``reduced``: the fast path reads their sum instead."""
    grads = [tf.constant(v, tf.float32) for v in values]
    towers_ = [_Tower(tf.constant(1.0), [tf.zeros_like(g) for g in grads], []),
               _Tower(tf.constant(2.0), grads, [])]

    def codes() -> tf.Tensor:
        summed = [a + b for a, b in zip(towers_[0].grads, towers_[1].grads)] if reduced else None
        return gather_codes(towers_, DEVICES[:2], DEVICES[0], summed)

    return [int(c) for c in (tf.function(codes)() if traced else codes()).numpy()]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("reduced", [False, True], ids=["towers", "reduced"])
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
def test_the_fused_sum_then_the_elementwise_pass_is_exact(values, finite, reduced, traced):
    """A finite total proves every element finite; a non-finite one (a NaN or Inf, or
    finite values whose sum overflowed) is decided elementwise: overflow is no alarm."""
    assert _codes(values, reduced=reduced, traced=traced) == [0, 0 if finite else 2]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"], ids=str)
def test_the_elementwise_pass_other_dtypes(dtype):
    big = tf.constant([6e4, 6e4] if dtype == "float16" else [1e38, 3e38], dtype)
    assert int(tower_code(tf.constant(1.0), [big, big], [])) == 0  # its sum would overflow
    assert int(tower_code(tf.constant(1.0), [big, tf.constant([np.nan], dtype)], [])) == 2
    total = tower_sum(tf.constant(1.0), [big, big], [])  # the fast path: doubt, not a verdict
    assert not np.isfinite(float(total))


def test_tower_code_bits_and_sparse_values():
    nan_slices = tf.IndexedSlices(tf.constant([[np.nan]]), tf.constant([0]), tf.constant([2, 1]))
    code = tower_code(tf.constant(np.inf), [tf.constant([BIG, BIG]), nan_slices],
                      [tf.constant([1.0]), tf.constant([7], tf.int64)])
    assert int(code) == 1 + 2
    assert int(tower_code(tf.constant(1.0), [tf.constant([BIG, BIG])],
                          [tf.constant([-np.inf])])) == 4


def _off_device_nodes(trainer: towers.TowerTrainer, batch: Any, device: str) -> int:
    """Nodes of the step's update (its functions and branches) placed on a device other
    than ``device``: each such device is one more partition of a nested update, run as
    its own executor every step."""
    step = trainer.compiled.steps[False]
    concrete = step.get_concrete_function(*batch_tensors(*batch, None, trainer.model))
    if step.nested:  # the update and its branches are functions in the step's library
        nodes = [n for f in concrete.graph.as_graph_def().library.function for n in f.node_def]
    else:  # two calls: the update's own function
        graph = step._updates[concrete].graph.as_graph_def()
        nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    return sum(1 for n in nodes if n.device and canonical_device(n.device) != device)


@pytest.mark.parametrize("nested", [True, False], ids=["one_call", "two_calls"])
def test_a_nested_update_checks_on_the_guard_device(nested: bool, monkeypatch) -> None:
    """One call per step (CPUs): the update's arguments arrive on one device and the guard
    checks them there, adding no node on another device (no partition, no executor run
    per device and step) — the guarded update is placed as the unguarded one. Two calls
    (GPUs): each tower's values are checked on its own device."""
    from towers.testing import ModelSpec

    monkeypatch.setattr("towers.compile.step.nests", lambda devices: nested)
    spec = ModelSpec("dense")
    built = {mode: towers.TowerTrainer(spec.build, keras.optimizers.SGD(0.1),
                                       "sparse_categorical_crossentropy", devices=DEVICES[:3],
                                       all_reduce="naive", on_nonfinite=mode)
             for mode in ("skip", "ignore")}  # fmt: skip
    x, y = spec.batch(6, seed=0)
    off = {mode: _off_device_nodes(t, (x, y), DEVICES[0]) for mode, t in built.items()}
    if nested:
        assert off["skip"] == off["ignore"]
    else:
        assert off["skip"] > off["ignore"]
    w = np.ones(6, "float32")
    w[-1] = np.nan  # tower 2's loss and gradients: caught either way
    built["skip"].train_step(x, y, w)
    assert built["skip"].last_step_nonfinite == {2: ["loss", "gradients"]}


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


@pytest.mark.long
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
