"""The peers' all-reduce checks, ported to towers and run for every registered algorithm.

Ported (inputs, shapes, tower counts and tolerances as the peers use them):

* TensorFlow ``tensorflow/python/distribute/v1/all_reduce_test.py``: ``testRingAllReduce``,
  ``testShuffleAllReduce``, ``testRecursiveHDAllReduce`` (via ``_testAllReduce``).
* TensorFlow ``cross_device_ops_test.py``: ``testAllReduceDense``,
  ``testBatchAllReduceMixedDenseAndSparse``.
* Horovod ``test/parallel/test_tensorflow.py``: ``test_horovod_allreduce_cpu``,
  ``test_horovod_allreduce_average_cpu``, ``test_horovod_allreduce_cpu_prescale`` /
  ``_postscale``, ``test_horovod_allreduce_min_cpu`` / ``max`` / ``product``.

Tower counts above 8 (TensorFlow's 2 workers x 8 GPUs = 16) run in one subprocess that
splits the CPU into 16 devices first (``python -m pytest -m long``). Cases with 32
devices (``4 x 8``) and the tests of TensorFlow's private helpers (``_ring_permutations``,
``_build_ring_gather``, ``_flatten_tensors``) have no counterpart here.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import towers

NAMES = sorted(towers.ALGORITHMS)
# TensorFlow's (workers x gpus, shape) cases of the three tests above, 32 devices left out
TF_CASES = [(2, ()), (2, (8,)), (2, (4, 4)), (6, (8,)), (8, (32,)), (8, (120,)),
            (16, (7, 13)), (16, (8, 8))]
HVD_DTYPES = (tf.int32, tf.int64, tf.float16, tf.float32, tf.float64)


def _devices() -> list[str]:
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def tf_all_reduce_case(name: str, n: int, shape: tuple[int, ...]) -> None:
    """TF ``_testAllReduce``: tower ``d`` holds ``i + 0.01 d`` at flat index ``i``; the
    outputs of a mean, added up, match ``add_n`` of the inputs (``assertAllClose``:
    rtol = atol = 1e-6)."""
    dim = int(np.prod(shape, dtype=int)) if shape else 1
    values = []
    for d, device in enumerate(_devices()[:n]):
        array = np.array([i + 0.01 * d for i in range(dim)], np.float32).reshape(shape)
        with tf.device(device):
            values.append(tf.constant(array))
    outs = towers.all_reduce(values, algorithm=name, op="mean")
    with tf.device(_devices()[0]):
        got = tf.add_n([tf.identity(o) for o in outs]).numpy()
        want = tf.add_n([tf.identity(v) for v in values]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{name} n={n} {shape}")


def _hvd_threshold(n: int, dtype: tf.DType) -> float | None:
    """Horovod's bound against exact multiplication; ``None``: Horovod skips the case."""
    if n <= 3 or dtype.is_integer:
        return 0.0
    if n < 10:
        return 1e-4
    if n < 15:
        return 5e-4
    return None


def _hvd_tensor(dim: int, dtype: tf.DType, seed: int) -> np.ndarray:
    """Horovod's ``random_uniform([17] * dim, -100, 100)``, the same on every rank."""
    rng = np.random.default_rng(seed)
    if dtype.is_integer:
        return rng.integers(-100, 100, [17] * dim)
    return rng.uniform(-100, 100, [17] * dim)


def _same_on_every_tower(array: np.ndarray, n: int, dtype: tf.DType) -> list[tf.Tensor]:
    out = []
    for device in _devices()[:n]:
        with tf.device(device):
            out.append(tf.constant(array, dtype))
    return out


def hvd_sum_case(name: str, n: int, op: str, prescale: float = 1.0,
                 postscale: float = 1.0, dtypes: tuple[tf.DType, ...] = HVD_DTYPES) -> None:
    """Horovod ``test_horovod_allreduce_cpu`` (and its ``average``, ``prescale`` and
    ``postscale`` variants): every rank all-reduces the same tensor; the result differs
    from ``tensor * size`` (times the factors, over ``size`` for the average) by at
    most Horovod's threshold for that size."""
    for dtype, dim in itertools.product(dtypes, (1, 2, 3)):
        threshold = _hvd_threshold(n, dtype)
        if threshold is None or (dtype.is_integer and (op == "mean" or prescale != 1.0
                                                       or postscale != 1.0)):
            continue  # Horovod skips the size; integer means and fractional factors are refused
        values = _same_on_every_tower(_hvd_tensor(dim, dtype, 1234 + dim), n, dtype)
        outs = towers.all_reduce(values, algorithm=name, op=op, prescale=prescale,
                                 postscale=postscale)
        x = values[0]
        multiplied = x * n if prescale == 1.0 else x * tf.constant(prescale, dtype) * n
        if postscale != 1.0:
            multiplied = multiplied * tf.constant(postscale, dtype)
        if op == "mean":
            multiplied = multiplied / n
        for tower, out in enumerate(outs):
            diff = float(tf.reduce_max(tf.abs(tf.cast(out, tf.float64)
                                              - tf.cast(multiplied, tf.float64))))
            assert diff <= threshold, f"{name} {dtype.name} dim {dim} tower {tower}/{n}: {diff}"


def hvd_min_max_product_case(name: str, n: int) -> None:
    """Horovod ``test_horovod_allreduce_{min,max,product}_cpu``: rank ``r`` holds its own
    random tensor; the result equals NumPy's reduction across ranks (product: within
    Horovod's ``assertAllClose``)."""
    for dtype, dim in itertools.product(HVD_DTYPES, (1, 2, 3)):
        arrays = [_hvd_tensor(dim, dtype, 7 * r + dim) for r in range(n)]
        values = []
        for array, device in zip(arrays, _devices()[:n]):
            with tf.device(device):
                values.append(tf.constant(array, dtype))
        held = np.stack([v.numpy().astype(np.float64) for v in values])
        for op, reduce in (("min", np.min), ("max", np.max)):
            for out in towers.all_reduce(values, algorithm=name, op=op):
                np.testing.assert_array_equal(out.numpy().astype(np.float64), reduce(held, 0))
        if dtype in (tf.float32, tf.float64) and n <= 3:  # Horovod's product: small values
            small = [_same_on_every_tower(a / 100, 1, dtype)[0] for a in arrays]
            placed = []
            for v, device in zip(small, _devices()[:n]):
                with tf.device(device):
                    placed.append(tf.identity(v))
            want = np.prod(np.stack([v.numpy() for v in placed]), 0)
            for out in towers.all_reduce(placed, algorithm=name, op="product"):
                np.testing.assert_allclose(out.numpy(), want, rtol=1e-6 if dtype == tf.float32
                                           else 1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_tf_v1_all_reduce_cases(name: str) -> None:
    """TF ``all_reduce_test.py`` ``testRingAllReduce`` / ``testShuffleAllReduce`` /
    ``testRecursiveHDAllReduce``, the cases of at most 8 devices."""
    for n, shape in TF_CASES:
        if n <= 8:
            tf_all_reduce_case(name, n, shape)


# Horovod's 1e-4 at 8 ranks holds for recursive doubling (x+x, 2x+2x, 4x+4x: exact); an
# algorithm that adds 8 equal fp16 values one after another rounds 3x, 5x, 6x and 7x.
RUNNING_ORDER = {"double_binary_tree", "naive", "nccl", "nccl_ring", "parameter_device",
                 "ring", "tree"}
HVD_CASES = [pytest.param(name, n, marks=pytest.mark.xfail(
    strict=True, reason="float16 sum of 8 equal values in running order exceeds Horovod's "
    "1e-4 (0.25-0.5 off)")) if n == 8 and name in RUNNING_ORDER else (name, n)
    for name in NAMES for n in (1, 2, 3, 4, 8)]


@pytest.mark.long
@pytest.mark.parametrize(("name", "n"), HVD_CASES)
def test_horovod_allreduce_cpu(name: str, n: int) -> None:
    """Horovod ``test_horovod_allreduce_cpu`` and ``test_horovod_allreduce_average_cpu``."""
    hvd_sum_case(name, n, "sum")
    hvd_sum_case(name, n, "mean")


@pytest.mark.parametrize("name", NAMES)
def test_horovod_allreduce_cpu_prescale_postscale(name: str) -> None:
    """Horovod ``test_horovod_allreduce_cpu_prescale`` and ``_postscale``."""
    factor = float(np.random.default_rng(0).uniform())
    for n in (2, 3, 4):
        hvd_sum_case(name, n, "sum", prescale=factor)
        hvd_sum_case(name, n, "sum", postscale=factor)


@pytest.mark.long
@pytest.mark.parametrize("name", NAMES)
def test_horovod_allreduce_min_max_product_cpu(name: str) -> None:
    """Horovod ``test_horovod_allreduce_{min,max,product}_cpu``."""
    for n in (2, 3, 8):
        hvd_min_max_product_case(name, n)


def _run_16() -> None:
    """The cases above 8 towers, every algorithm, in this (fresh) process.

    Fails on any TensorFlow 16-device case and any Horovod case at 10 and 14 ranks but
    float16's; float16 there is printed, not failed: Horovod's 1e-4 / 5e-4 of ``n x`` do
    not hold for a float16 sum of 10 or 14 equal values in most summation orders (the
    ``RUNNING_ORDER`` note above; at 10 and 14 ranks even doubling orders round).
    """
    towers.simulate_devices(16, kind="cpu")
    failures, float16 = [], []
    for name in NAMES:
        for n, shape in TF_CASES:
            if n > 8:
                try:
                    tf_all_reduce_case(name, n, shape)
                except AssertionError as err:
                    failures.append(f"{name} n={n} {shape}: {str(err).splitlines()[0:6]}")
        for n in (10, 14):
            try:
                hvd_sum_case(name, n, "sum", dtypes=tuple(d for d in HVD_DTYPES
                                                          if d != tf.float16))
            except AssertionError as err:
                failures.append(f"{name} hvd n={n}: {err}")
            try:
                hvd_sum_case(name, n, "sum", dtypes=(tf.float16,))
            except AssertionError as err:
                float16.append(f"{name} hvd n={n}: {str(err).splitlines()[0]}")
    print("float16 beyond Horovod's bound:", *float16, sep="\n")
    print("\n".join(failures) or "all passed")
    sys.exit(1 if failures else 0)


@pytest.mark.long
def test_peer_cases_above_eight_towers() -> None:
    """TF's 2 x 8 = 16 device cases (and Horovod's sizes 10 and 14) in one subprocess."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", "from tests.allreduce.test_peers import "
                           "_run_16; _run_16()"], capture_output=True, text=True, env=env,
                          timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.parametrize("name", NAMES)
def test_cross_device_ops_all_reduce_dense(name: str) -> None:
    """TF ``cross_device_ops_test.py`` ``testAllReduceDense``: replica ``i`` holds
    ``[1.0, 2.0, 3.0, 4.0][i]`` at group sizes 1, 2, 4; sum 1, 3, 10 and mean 1, 1.5, 2.5."""
    expect = {1: (1.0, 1.0), 2: (3.0, 1.5), 4: (10.0, 2.5)}
    for n, (total, mean) in expect.items():
        values = _devices_values([1.0, 2.0, 3.0, 4.0][:n])
        for op, want in (("sum", total), ("mean", mean)):
            for out in towers.all_reduce(values, algorithm=name, op=op):
                np.testing.assert_allclose(out.numpy(), want)


def _devices_values(scalars: list[float]) -> list[tf.Tensor]:
    out = []
    for x, device in zip(scalars, _devices()):
        with tf.device(device):
            out.append(tf.constant(x))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_cross_device_ops_batch_all_reduce_mixed_dense_and_sparse(name: str) -> None:
    """TF ``cross_device_ops_test.py`` ``testBatchAllReduceMixedDenseAndSparse``: two
    replicas each reduce ``[dense, dense, IndexedSlices, IndexedSlices]`` in one batch;
    the sparse ones come back gathered in replica order (``towers.allreduce.grouped``)."""
    data = [[1.0, 2.0, ([[1.0], [2.0]], [0, 1], [10, 1]), ([[3.0], [4.0]], [1, 2], [5, 1])],
            [3.0, 4.0, ([[5.0], [6.0]], [1, 2], [10, 1]), ([[7.0], [8.0]], [0, 1], [5, 1])]]
    values = []
    for row, device in zip(data, _devices()):
        with tf.device(device):
            values.append([tf.constant(x) if isinstance(x, float) else
                           tf.IndexedSlices(tf.constant(x[0]), tf.constant(x[1], tf.int64),
                                            tf.constant(x[2], tf.int64)) for x in row])
    for out in towers.allreduce.grouped(values, name, "sum"):
        np.testing.assert_allclose([out[0].numpy(), out[1].numpy()], [4.0, 6.0])
        for got, (vals, idx, shape) in zip(out[2:], [([[1.0], [2.0], [5.0], [6.0]],
                                                      [0, 1, 1, 2], [10, 1]),
                                                     ([[3.0], [4.0], [7.0], [8.0]],
                                                      [1, 2, 0, 1], [5, 1])]):
            np.testing.assert_allclose(got.values.numpy(), vals)
            np.testing.assert_array_equal(got.indices.numpy(), idx)
            np.testing.assert_array_equal(got.dense_shape.numpy(), shape)
