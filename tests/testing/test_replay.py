"""The NumPy replay is bitwise equal to TensorFlow on CPU, and pins what TF does to sums."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers.allreduce import naive, parameter_device, send
from towers.allreduce.machinery.base import OPS, check_values, combine, finish
from towers.testing.replay import KERNELS, ReplayError, replay

BF16 = np.dtype(ml_dtypes.bfloat16)


def _adversarial(n: int, size: int, dtype: object = np.float32, seed: int = 0) -> list[np.ndarray]:
    """Values over twelve decades, so that any change of summation order shows in the bits."""
    rng = np.random.default_rng(seed)
    top = 3 if np.dtype(dtype) == np.float16 else 8  # float16 overflows past 65504
    decades = 10.0 ** rng.integers(-4, top, size=(n, size))
    return [(rng.standard_normal(size) * decades[i]).astype(dtype) for i in range(n)]


def _place(arrays: Sequence[np.ndarray], devices: Sequence[str]) -> list[tf.Tensor]:
    values = []
    for array, device in zip(arrays, devices, strict=True):
        with tf.device(device):
            values.append(tf.identity(tf.constant(array)))
    return values


def _eager(algorithm: Callable, arrays: Sequence[np.ndarray], op: str = "sum", devices=None):
    devices = devices or DEVICES[: len(arrays)]
    return [o.numpy() for o in algorithm(_place(arrays, devices), op=op)]


def _in_function(algorithm: Callable, arrays: Sequence[np.ndarray], op: str = "sum"):
    """Run as training would, in a tf.function (argument names as replay's: grappler sorts)."""
    devices = DEVICES[: len(arrays)]

    def body(*args):
        values = []
        for arg, device in zip(args, devices, strict=True):
            with tf.device(device):
                values.append(tf.identity(arg))
        return algorithm(values, op=op)

    fn = tf.function(body, autograph=False)
    return [o.numpy() for o in fn(*_place(arrays, devices))]


def _assert_bitwise(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape, (i, a.dtype, e.dtype, a.shape, e.shape)
        a_bytes, e_bytes = (np.frombuffer(x.tobytes(), np.uint8) for x in (a, e))
        assert a.tobytes() == e.tobytes(), f"output {i}: {np.sum(a_bytes != e_bytes)} bytes differ"


def chunked(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A hand-written reduce-scatter + all-gather: pad, strided slices, concat, reshape.

    Chunk j is reduced on tower j, starting with tower j + 1's piece, so each chunk
    adds in its own rotated order (not naive's).
    """
    devices = check_values(values, op)
    n, shape = len(values), values[0].shape
    size = shape.num_elements()
    c = -(-size // n)
    flat = []
    for v, d in zip(values, devices, strict=True):
        with tf.device(d):
            flat.append(tf.pad(tf.reshape(v, [-1]), [[0, c * n - size]]))
    owned = []
    for j, dst in enumerate(devices):
        total = None
        for step in range(n):
            src = (j + 1 + step) % n
            with tf.device(devices[src]):
                piece = flat[src][j * c : (j + 1) * c]
            piece = send(piece, dst)
            with tf.device(dst):
                total = piece if total is None else combine(total, piece, op)
        with tf.device(dst):
            owned.append(finish(total, op, n))
    outs = []
    for d in devices:
        with tf.device(d):
            gathered = tf.concat([send(owned[j], d) for j in range(n)], axis=0)
            outs.append(tf.reshape(gathered[:size], shape))
    return outs


ALGORITHMS = {"naive": naive, "parameter_device": parameter_device(), "chunked": chunked}


def test_values_are_order_sensitive() -> None:
    xs = _adversarial(5, 1000)
    forward, backward = xs[0], xs[-1]
    for x in xs[1:]:
        forward = forward + x
    for x in xs[-2::-1]:
        backward = backward + x
    assert np.sum(forward != backward) > 100  # so bitwise equality below means something


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("op", OPS)
def test_replay_is_bitwise_equal_to_eager_float32(name: str, n: int, op: str) -> None:
    xs = _adversarial(n, 37, seed=n)
    _assert_bitwise(replay(ALGORITHMS[name], xs, op), _eager(ALGORITHMS[name], xs, op))


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("dtype", [np.float64, np.float16, BF16])
def test_replay_is_bitwise_equal_in_other_dtypes(name: str, dtype: object) -> None:
    xs = _adversarial(5, 101, dtype, seed=3)
    for op in ("sum", "mean"):
        got = replay(ALGORITHMS[name], xs, op)
        assert got[0].dtype == np.dtype(dtype)  # never upcast
        _assert_bitwise(got, _eager(ALGORITHMS[name], xs, op))


def test_replay_follows_each_algorithms_own_order() -> None:
    xs = _adversarial(5, 1000)
    by_naive, by_chunks = replay(naive, xs)[0], replay(chunked, xs)[0]
    assert np.sum(by_naive != by_chunks) > 100


def test_replay_handles_scalars_empty_tensors_and_a_parameter_device_off_the_towers() -> None:
    for shape in [(), (0,), (2, 3)]:
        xs = [np.full(shape, i + 0.5, np.float32) for i in range(3)]
        for algorithm in (chunked, parameter_device(DEVICES[7])):
            _assert_bitwise(replay(algorithm, xs), _eager(algorithm, xs))


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("n", [3, 8])
def test_optimized_replay_is_bitwise_equal_to_tf_function(name: str, n: int) -> None:
    xs = _adversarial(n, 37, seed=n)
    for op in ("sum", "mean"):
        got = replay(ALGORITHMS[name], xs, op, optimized=True)
        _assert_bitwise(got, _in_function(ALGORITHMS[name], xs, op))


# -- what TensorFlow does to sums (the module docstring's measured facts) ----------------------


def _sequential(xs: Sequence[np.ndarray]) -> np.ndarray:
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


@pytest.mark.parametrize("k", [2, 3, 8, 9, 10, 11, 16, 17, 18, 25])
def test_addn_order_on_cpu(k: int) -> None:
    xs = _adversarial(k, 2000, seed=k)
    tf_result = tf.add_n([tf.constant(x) for x in xs]).numpy()
    _assert_bitwise(
        replay(lambda vs, op: [tf.add_n(vs)], xs, devices=[DEVICES[0]] * k), [tf_result]
    )
    if k <= 9:  # strictly left to right
        _assert_bitwise([_sequential(xs)], [tf_result])
    else:  # a head of k mod 8 (8 for 0, 9 for 1), then blocks of 8 added as block sums
        head = {0: 8, 1: 9}.get(k % 8, k % 8)
        total = _sequential(xs[:head])
        for start in range(head, k, 8):
            total = total + _sequential(xs[start : start + 8])
        _assert_bitwise([total], [tf_result])
        assert np.any(_sequential(xs) != tf_result)


def test_grappler_turns_mean_division_into_a_reciprocal_multiply() -> None:
    xs = _adversarial(3, 1000)
    eager, in_function = _eager(naive, xs, "mean"), _in_function(naive, xs, "mean")
    assert np.sum(eager[0] != in_function[0]) > 100
    total = _sequential(xs)
    _assert_bitwise([eager[0], in_function[0]], [total / np.float32(3), total * np.float32(1 / 3)])
    _assert_bitwise(replay(naive, xs, "mean"), eager)
    _assert_bitwise(replay(naive, xs, "mean", optimized=True), in_function)


def _named_sum(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    with tf.device(values[0].device):
        z = tf.negative(values[0], name="z_first")
        b = tf.negative(values[1], name="b_second")
        a = tf.negative(values[2], name="a_third")
        return [(z + b) + a, tf.add_n([z, b, a])]


def test_grappler_sorts_sum_inputs_by_node_name() -> None:
    xs = [np.float32([1.0]), np.float32([2**-24]), np.float32([2**-24])]
    as_written = _eager(_named_sum, xs)  # (-1 - 2^-24) - 2^-24 rounds to -1 twice
    in_function = _in_function(_named_sum, xs)  # (-2^-24 - 2^-24) - 1 = -(1 + 2^-23)
    assert [float(v[0]) for v in as_written] == [-1.0, -1.0]
    assert [float(v[0]) for v in in_function] == [-(1 + 2**-23)] * 2
    _assert_bitwise(replay(_named_sum, xs), as_written)
    _assert_bitwise(replay(_named_sum, xs, optimized=True), in_function)


def _chain(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    with tf.device(DEVICES[0]):
        return [_sequential(values)]


def test_grappler_turns_a_chain_of_ten_adds_into_addn() -> None:
    xs = _adversarial(10, 2000, seed=10)
    devices = [DEVICES[0]] * 10
    written = replay(_chain, xs, devices=devices)
    optimized = replay(_chain, xs, devices=devices, optimized=True)
    _assert_bitwise(written, [_sequential(xs)])
    _assert_bitwise(optimized, [tf.add_n([tf.constant(x) for x in xs]).numpy()])
    assert np.any(written[0] != optimized[0])


# -- every kernel against TensorFlow ----------------------------------------------------------

_RNG = np.random.default_rng(7)
_M = (_RNG.standard_normal((4, 6)) * 100).astype(np.float32)
_N = (_RNG.standard_normal((4, 6)) * 1e-3).astype(np.float32)
_I = np.array([[-7, 7, -8, 9], [5, -5, 3, -1]], np.int32)
_J = np.array([[2, -2, 3, 4], [-3, 2, 2, -1]], np.int32)

KERNEL_CASES: list[tuple[str, Callable, list[np.ndarray]]] = [
    ("AddV2", lambda x, y: x + y, [_M, _N]),
    ("Add", lambda x, y: tf.raw_ops.Add(x=x, y=y), [_M, _N]),
    ("AddN", lambda x, y: tf.add_n([x, y, x]), [_M, _N]),
    ("Sub", tf.subtract, [_M, _N]),
    ("Mul", tf.multiply, [_M, _N]),
    ("RealDiv", lambda x, y: x / y, [_M, _N]),
    ("Div", lambda x, y: tf.raw_ops.Div(x=x, y=y), [_I, _J]),
    ("Div", lambda x, y: tf.raw_ops.Div(x=x, y=y), [_M, _N]),
    ("FloorDiv", tf.math.floordiv, [_I, _J]),
    ("FloorDiv", tf.math.floordiv, [_M, _N]),
    ("FloorMod", tf.math.floormod, [_I, _J]),
    ("FloorMod", tf.math.floormod, [_M, _N]),
    ("Maximum", tf.maximum, [_M, _N]),
    ("Minimum", tf.minimum, [_M, _N]),
    ("Neg", tf.negative, [_M]),
    ("Cast", lambda x: tf.cast(x, tf.bfloat16), [_M]),
    ("Cast", lambda x: tf.cast(x, tf.float16), [_M]),
    ("Cast", lambda x: tf.cast(x, tf.int32), [_M]),
    ("Cast", lambda x: tf.cast(tf.cast(x, tf.float16), tf.float64), [_M]),
    ("Reshape", lambda x: tf.reshape(x, [3, -1]), [_M]),
    ("Pad", lambda x: tf.pad(x, [[1, 2], [0, 3]]), [_M]),
    ("PadV2", lambda x: tf.pad(x, [[1, 0], [2, 1]], constant_values=7.5), [_M]),
    ("ConcatV2", lambda x, y: tf.concat([x, y], axis=-1), [_M, _N]),
    ("Pack", lambda x, y: tf.stack([x, y], axis=1), [_M, _N]),
    ("Unpack", lambda x: tf.unstack(x, axis=1), [_M]),
    ("Split", lambda x: tf.split(x, 3, axis=1), [_M]),
    ("SplitV", lambda x: tf.split(x, [1, -1, 2], axis=1), [_M]),
    ("Slice", lambda x: tf.slice(x, [1, 2], [-1, 3]), [_M]),
    ("StridedSlice", lambda x: x[1:, ::2], [_M]),
    ("StridedSlice", lambda x: x[::-1, -2:], [_M]),
    ("StridedSlice", lambda x: x[::-2, 4:0:-3], [_M]),
    ("StridedSlice", lambda x: x[..., 1], [_M]),
    ("StridedSlice", lambda x: x[-1], [_M]),
    ("StridedSlice", lambda x: x[:, tf.newaxis, 1:3], [_M]),
    ("StridedSlice", lambda x: x[tf.newaxis, ..., -1], [_M]),
    ("StridedSlice", lambda x: x[1:-1, ...], [_M]),
    ("StridedSlice", lambda x: x[10:, 1:100], [_M]),
    ("Squeeze", lambda x: tf.squeeze(tf.reshape(x, [1, 4, 1, 6])), [_M]),
    ("Squeeze", lambda x: tf.squeeze(tf.reshape(x, [1, 4, 1, 6]), axis=[2]), [_M]),
    ("ExpandDims", lambda x: tf.expand_dims(x, -1), [_M]),
    ("Shape", lambda x: tf.raw_ops.Shape(input=x, out_type=tf.int64), [_M]),
    ("Size", lambda x: tf.raw_ops.Size(input=x), [_M]),
    ("Rank", lambda x: tf.raw_ops.Rank(input=x), [_M]),
    ("Fill", lambda x: tf.fill(tf.shape(x), 2.5), [_M]),
    ("ZerosLike", lambda x: tf.raw_ops.ZerosLike(x=x), [_I]),
    ("OnesLike", lambda x: tf.raw_ops.OnesLike(x=x), [_M]),
    ("Range", lambda x: tf.range(0.1, 3.0, 0.3) + x[0, 0], [_M]),
    ("Range", lambda x: tf.range(10, -3, -4), [_M]),
    ("GatherV2", lambda x: tf.gather(x, [2, 0, 2], axis=1), [_M]),
    ("Transpose", tf.transpose, [_M]),
    ("IdentityN", lambda x, y: tf.identity_n([x, y]), [_M, _N]),
    ("Const", lambda x: x + tf.constant([1.5, -2.0, 3.25, 0.0, 1e-3, 7.0]), [_M]),
]


def _as_list(result: object) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]


@pytest.mark.parametrize(
    ("op_type", "fn", "inputs"),
    KERNEL_CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(KERNEL_CASES)],
)
def test_kernel_matches_tensorflow(op_type: str, fn: Callable, inputs: list[np.ndarray]) -> None:
    def algorithm(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        return _as_list(fn(*values))

    devices = [DEVICES[0]] * len(inputs)
    specs = [tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)) for x in inputs]
    graph = (
        tf.function(lambda *a: algorithm(a), autograph=False).get_concrete_function(*specs).graph
    )
    assert op_type in {o.type for o in graph.get_operations()}  # the kernel really runs
    expected = [t.numpy() for t in _as_list(fn(*[tf.constant(x) for x in inputs]))]
    _assert_bitwise(replay(algorithm, inputs, devices=devices), expected)


def test_control_inputs_and_noop_are_ignored() -> None:
    def algorithm(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        with tf.control_dependencies([tf.no_op()]):
            return [tf.identity(values[0]) + 1.0]

    _assert_bitwise(replay(algorithm, [_M]), [_M + np.float32(1)])
    assert "NoOp" in KERNELS


def test_captured_tensors_are_read() -> None:
    scale = tf.constant(np.float32(3.0))
    _assert_bitwise(replay(lambda vs, op: [vs[0] * scale], [_M]), [_M * np.float32(3)])


def test_unsupported_op_raises_replay_error_naming_it() -> None:
    with pytest.raises(ReplayError, match=r"'Sum'.*Supported: .*AddN"):
        replay(lambda vs, op: [tf.reduce_sum(tf.stack(vs), axis=0)], _adversarial(2, 5))


def test_collective_ops_are_opaque() -> None:
    from tensorflow.python.ops import collective_ops

    def collective(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        return [collective_ops.all_reduce_v2(v, len(values), 1, 1) for v in values]

    with pytest.raises(ReplayError, match=r"opaque.*CollectiveReduceV2"):
        replay(collective, _adversarial(2, 5))


def test_registry_is_extensible_and_lists_the_ops() -> None:
    assert {"AddN", "StridedSlice", "Transpose"} <= set(KERNELS)
    KERNELS["Abs"] = lambda op, xs: [np.abs(xs[0])]
    try:
        _assert_bitwise(replay(lambda vs, op: [tf.abs(vs[0])], [_N]), [np.abs(_N)])
    finally:
        del KERNELS["Abs"]


def test_too_few_devices_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="simulate_devices"):
        replay(naive, _adversarial(3, 2), devices=DEVICES[:2])
