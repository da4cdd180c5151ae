"""Bucketed all-reduce: pack/unpack round trip, bucket layout, every output, training.

Error bounds. Packing and unpacking only copy (reshape, concat, split), so they are
tested bitwise. A bucket is reduced by the wrapped algorithm element by element, so
every output element is a sum of the n towers' elements of summation depth at most
``n - 1`` (any algorithm here): ``|out - Σx| ≤ γ_{n-1}·Σ|x|`` (derived in
``tests/allreduce/machinery/test_primitives.py``, checked there with exact fractions). With
``naive`` the per-element order (tower order, left to right) does not depend on the
packing at all, so bucketed naive must equal per-variable naive bitwise; for a ring
the per-step SGD bound of ``towers.testing.sgd_step_bound`` (depth n − 1) applies.
"""

from __future__ import annotations

import itertools
from typing import Any

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

import towers
from reference import MirroredTrainer
from tests.allreduce.machinery.test_primitives import assert_matches_reference, place
from tests.conftest import DEVICES
from tests.strategies import OPTIMIZERS
from towers.allreduce import as_written, naive, ring
from towers.allreduce.bucketed import Layout, bucketed, pack, plan, unpack
from towers.allreduce.machinery.primitives import record
from towers.devices import canonical_device
from towers.testing import (
    ModelSpec,
    assert_weights_close,
    loss_fn,
    per_tower_gradients,
    sgd_step_bound,
)
from towers.training.data import digits
from towers.training.models import digits_cnn

NUMPY_DTYPES = {
    tf.float16: np.float16,
    tf.bfloat16: ml_dtypes.bfloat16,
    tf.float32: np.float32,
    tf.float64: np.float64,
    tf.int32: np.int32,
    tf.int64: np.int64,
}
SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)  # () and 0-dims too
SPECS = st.lists(st.tuples(SHAPES, st.sampled_from(list(NUMPY_DTYPES))), max_size=8)
LIMITS = st.one_of(st.none(), st.integers(1, 96))


def _raw_tensor(shape: tuple[int, ...], dtype: tf.DType, data: bytes, device: str) -> tf.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals, infinities) of ``dtype``."""
    size = int(np.prod(shape)) * dtype.size
    raw = (data * (size // max(len(data), 1) + 1))[:size]
    array = np.frombuffer(raw, NUMPY_DTYPES[dtype]).reshape(shape)
    with tf.device(device):
        return tf.identity(tf.constant(array))


@given(SPECS, LIMITS, st.binary(min_size=1, max_size=64), st.integers(0, 7))
def test_unpack_of_pack_is_bitwise_identity(
    specs: list[tuple[tuple[int, ...], tf.DType]], limit: int | None, data: bytes, tower: int
) -> None:
    xs = [_raw_tensor(s, d, data[k:] + data[:k], DEVICES[tower]) for k, (s, d) in enumerate(specs)]
    buckets, layout = pack(xs, limit)
    assert all(canonical_device(b.device) == DEVICES[tower] for b in buckets)
    ys = unpack(buckets, layout)
    assert len(ys) == len(xs)
    for k, (x, y) in enumerate(zip(xs, ys)):
        assert y.dtype == x.dtype and y.shape == x.shape, f"tensor {k}"
        assert y.numpy().tobytes() == x.numpy().tobytes(), f"tensor {k} differs bitwise"
        assert canonical_device(y.device) == DEVICES[tower]


@given(SPECS, LIMITS)
def test_plan_packs_in_reverse_order_into_full_single_dtype_buckets(
    specs: list[tuple[tuple[int, ...], tf.DType]], limit: int | None
) -> None:
    layout = plan(specs, limit)
    slots = [s for b in layout.buckets for s in b.slots]
    assert sorted(s.index for s in slots) == list(range(len(specs)))  # each tensor once
    last_of: dict[tf.DType, int] = {}
    for b in layout.buckets:
        assert b.size == sum(s.size for s in b.slots) and b.slots
        offset = 0
        for s in b.slots:
            shape, dtype = specs[s.index]
            assert tf.as_dtype(dtype) == b.dtype and s.shape == shape
            assert s.offset == offset and s.size == int(np.prod(shape))
            offset += s.size
            # reverse variable order within a dtype, across buckets too
            assert s.index < last_of.get(b.dtype, len(specs))
            last_of[b.dtype] = s.index
        if limit is None:
            continue
        assert b.nbytes <= limit or len(b.slots) == 1, "only a lone tensor may overflow"
    if limit is None:  # one bucket per dtype
        assert len(layout.buckets) == len({tf.as_dtype(d) for _, d in specs})
        return
    same: dict[tf.DType, list[Any]] = {}
    for b in layout.buckets:
        same.setdefault(b.dtype, []).append(b)
    for row in same.values():  # greedy: the next bucket's first tensor did not fit
        for a, b in itertools.pairwise(row):
            assert a.nbytes + b.slots[0].size * b.dtype.size > limit or a.nbytes >= limit


def test_plan_matches_the_docstring_picture() -> None:
    f32 = tf.float32
    # w0 b0 w1 b1 w2 b2 with B = 64 bytes: w1 (96 bytes) is alone
    specs = [((4, 2), f32), ((2,), f32), ((8, 3), f32), ((3,), f32), ((3, 3), f32), ((3,), f32)]
    layout = plan(specs, 64)
    assert [[s.index for s in b.slots] for b in layout.buckets] == [[5, 4, 3], [2], [1, 0]]
    assert [b.nbytes for b in layout.buckets] == [60, 96, 40]
    assert plan(specs, None).buckets[0].size == 8 + 2 + 24 + 3 + 9 + 3
    assert plan([], 64) == Layout((), 0)


def test_mixed_dtypes_get_separate_buckets_in_opening_order() -> None:
    specs = [((2,), tf.float32), ((2,), tf.float64), ((2,), tf.float32), ((), tf.int32)]
    layout = plan(specs, None)
    assert [(b.dtype, [s.index for s in b.slots]) for b in layout.buckets] == [
        (tf.int32, [3]),
        (tf.float32, [2, 0]),
        (tf.float64, [1]),
    ]


@pytest.mark.parametrize("limit", [0, -8, 1.5, True, "64"])
def test_bad_bytes_per_bucket_is_refused(limit: Any) -> None:
    with pytest.raises(ValueError, match="bytes_per_bucket"):
        bucketed("ring", limit)
    with pytest.raises(ValueError, match="bytes_per_bucket"):
        plan([((2,), tf.float32)], limit)


def test_bad_algorithm_and_mismatched_buckets_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown all_reduce 'butterfly'"):
        bucketed("butterfly")
    buckets, layout = pack([tf.ones([3]), tf.ones([2])], 12)
    with pytest.raises(ValueError, match="got 1 buckets"):
        unpack(buckets[:1], layout)
    with pytest.raises(ValueError, match=r"buckets\[0\] is float32 \(3,\), expected"):
        unpack([tf.ones([3]), buckets[0]], layout)


def _tower_grads(n: int, shapes: list[tuple[int, ...]], seed: int) -> list[list[tf.Tensor]]:
    rng = np.random.default_rng(seed)
    per_var = [place([rng.normal(size=s).astype(np.float32) for _ in range(n)]) for s in shapes]
    return [[per_var[j][t] for j in range(len(shapes))] for t in range(n)]


@given(
    n=st.integers(1, 8),
    shapes=st.lists(SHAPES, min_size=1, max_size=6),
    limit=LIMITS,
    algorithm=st.sampled_from(["naive", "ring", "tree"]),
    seed=st.integers(0, 2**16),
)
def test_every_output_is_the_sum_within_the_depth_bound(
    n: int, shapes: list[tuple[int, ...]], limit: int | None, algorithm: str, seed: int
) -> None:
    grads = _tower_grads(n, shapes, seed)
    reducer = bucketed(algorithm, limit)
    reducer.build([tf.Variable(g) for g in grads[0]], DEVICES[:n])
    outs = reducer.reduce_gradients(grads)
    per_var = [[g[j] for g in grads] for j in range(len(shapes))]
    exact_naive = [naive(v) for v in per_var]  # per-variable naive, tower-order sums
    for t in range(n):
        for j, out in enumerate(outs[t]):
            assert canonical_device(out.device) == DEVICES[t], f"tower {t} var {j}"
            assert out.numpy().tobytes() == outs[0][j].numpy().tobytes(), f"tower {t} var {j}"
            if algorithm == "naive":  # same per-element order: bitwise
                assert out.numpy().tobytes() == exact_naive[j][t].numpy().tobytes()
    for j in range(len(shapes)):
        assert_matches_reference([outs[0][j].numpy()], [v.numpy() for v in per_var[j]], "sum",
                                 max(n - 1, 0))


def test_buckets_are_reduced_last_variable_first_and_bytes_match_the_ring() -> None:
    n, shapes = 4, [(8, 4), (4,), (16, 4), (4,)]  # 128, 16, 256, 16 bytes
    calls: list[int] = []

    def spy(values: list[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        calls.append(int(values[0].shape[0]))
        return ring()(values, op=op)

    grads = _tower_grads(n, shapes, 0)
    reducer = bucketed(spy, 144)
    reducer.build([tf.Variable(g) for g in grads[0]], DEVICES[:n])
    with record() as rec:
        reducer.reduce_gradients(grads)
    # reverse order: [b3 (4)] + w2 (64) overflows 144 bytes -> [b3], [w2], [b1 | w0]
    assert calls == [4, 64, 4 + 32]
    sent = rec.bytes_sent()  # ring: 2(n-1)/n of each bucket (sizes divide by 4: no padding)
    assert [sent[d] for d in DEVICES[:n]] == [2 * 3 * (16 + 256 + 144) // 4] * n


def _digits_batch(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    x, y, _, _ = digits()
    idx = np.random.default_rng(seed).choice(len(x), size, replace=False)
    return x[idx], y[idx]


@pytest.mark.long
@pytest.mark.parametrize(
    ("family", "placement"),
    [("digits", "replicated"), ("embedding", "parameter_device"), ("batchnorm", "replicated")],
)
def test_bucketed_naive_trains_bitwise_like_naive(family: str, placement: str) -> None:
    # digits_cnn: conv + dense; embedding: its sparse gradient bypasses the reducer;
    # batchnorm: non-trainable state. 13 examples over 4 towers: shards 4, 3, 3, 3.
    n = 4
    spec = ModelSpec(family if family != "digits" else "dense", seed=3)
    make = digits_cnn if family == "digits" else spec.build
    runs = []
    for reducer in ["naive", bucketed("naive", None), bucketed("naive", 256)]:
        trainer = towers.TowerTrainer(make, OPTIMIZERS["adam"], loss_fn(), devices=DEVICES[:n],
                                      all_reduce=reducer, variables=placement)
        for k in range(3):
            trainer.train_step(*(_digits_batch(13, k) if family == "digits" else spec.batch(13, k)))
        runs.append(trainer.replica_weights())
    for run in runs[1:]:
        for replica, expected in zip(run, runs[0]):
            for a, b in zip(replica, expected):
                assert a.tobytes() == b.tobytes()


@pytest.mark.long
def test_bucketed_ring_trains_like_the_reference_within_the_bound() -> None:
    n, lr = 4, 0.1
    opt = lambda: keras.optimizers.SGD(lr)  # noqa: E731
    trainer = towers.TowerTrainer(digits_cnn, opt, loss_fn(), devices=DEVICES[:n],
                                  all_reduce=bucketed("ring", 1024), variables="replicated")
    ref = MirroredTrainer(digits_cnn, opt, loss_fn(), DEVICES[:n],
                          cross_device_ops="reduction_to_one_device")
    assert len(trainer.algorithm.layout.buckets) > 2  # 1 KiB buckets: several of them
    for k, size in enumerate([64, 64]):
        start = trainer.get_weights()
        ref.set_weights(start)
        x, y = _digits_batch(size, k)
        grads = per_tower_gradients(trainer.model, x, y, DEVICES[:n])
        with as_written():  # both: towers' forward graph follows the caller's settings
            trainer.train_step(x, y)
            ref.train_step(x, y)
        # two summation orders of depth ≤ n − 1 (ring vs tower order): sgd_step_bound
        bound = sgd_step_bound(start, grads, lr, depth=n - 1)
        assert_weights_close(trainer.get_weights(), ref.get_weights(), atol=bound, what=f"step {k}")
    copies = trainer.replica_weights()
    for replica in copies[1:]:
        for a, b in zip(copies[0], replica):
            assert a.tobytes() == b.tobytes()
