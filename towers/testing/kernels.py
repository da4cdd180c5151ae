"""The replay's NumPy kernels, one per TensorFlow op type, rounding as TF's CPU kernels do."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["KERNELS", "Kernel", "ReplayError", "np_dtype"]

Kernel = Callable[[tf.Operation, list[np.ndarray]], list[np.ndarray]]


class ReplayError(RuntimeError):
    """The graph holds an op the replay cannot follow (unknown, or opaque)."""


def np_dtype(dtype: tf.DType) -> np.dtype:
    """The NumPy dtype of a TensorFlow dtype (bfloat16 included)."""
    return np.dtype(tf.as_dtype(dtype).as_numpy_dtype)


def _elementwise(fn: Callable[..., Any]) -> Kernel:
    def kernel(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
        with np.errstate(all="ignore"):
            return [np.asarray(fn(*xs))]

    return kernel


def _add_n(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    # <= 9 inputs left to right; else a head of n mod 8 (8 for 0, 9 for 1), then
    # `total + (block of 8, left to right)` (towers.testing.replay)
    n = len(xs)
    head = n if n <= 9 else {0: 8, 1: 9}.get(n % 8, n % 8)
    with np.errstate(all="ignore"):
        total = np.asarray(functools.reduce(np.add, xs[:head]))
        for start in range(head, n, 8):
            total = np.asarray(total + functools.reduce(np.add, xs[start : start + 8]))
    return [total]


def _divide(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``Div``/``RealDiv``: true division for floats; integers round toward zero, as C++."""
    if np.issubdtype(x.dtype, np.integer):
        q = x // y
        return np.asarray(q + ((q < 0) & (q * y != x)).astype(x.dtype))
    return np.asarray(np.true_divide(x, y))


def _floor_div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer):
        return np.asarray(np.floor_divide(x, y))
    return np.asarray(np.floor(np.true_divide(x, y)))  # TF: floor(x / y), one rounding


def _cast(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    if op.get_attr("Truncate"):
        raise ReplayError(f"{op.name}: Cast with Truncate=True is not supported")
    with np.errstate(all="ignore"):
        return [xs[0].astype(np_dtype(op.get_attr("DstT")))]


def _pad(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    x, paddings = xs[0], xs[1].tolist()
    value = xs[2] if len(xs) > 2 else np.zeros((), x.dtype)
    out = np.full([d + lo + hi for d, (lo, hi) in zip(x.shape, paddings, strict=True)], value,
                  x.dtype)  # fmt: skip
    out[tuple(slice(lo, lo + d) for d, (lo, _) in zip(x.shape, paddings, strict=True))] = x
    return [out]


def _split_v(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    x, sizes, axis = xs[0], xs[1].tolist(), int(xs[2])
    if -1 in sizes:
        sizes[sizes.index(-1)] = x.shape[axis] - (sum(sizes) + 1)
    return list(np.split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis))


def _slice(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    x, begin, size = xs[0], xs[1].tolist(), xs[2].tolist()
    return [x[tuple(slice(b, x.shape[i] if s == -1 else b + s)
                    for i, (b, s) in enumerate(zip(begin, size, strict=True)))]]


def _strided_slice(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    x, begin, end, strides = xs[0], xs[1].tolist(), xs[2].tolist(), xs[3].tolist()
    masks = [op.get_attr(f"{m}_mask") for m in ("ellipsis", "new_axis", "shrink_axis",
                                                   "begin", "end")]  # fmt: skip
    index: list[Any] = []
    for i, (b, e, s) in enumerate(zip(begin, end, strides, strict=True)):
        ellipsis, new_axis, shrink, no_begin, no_end = (m >> i & 1 for m in masks)
        if ellipsis:
            index.append(Ellipsis)
        elif new_axis:
            index.append(np.newaxis)
        elif shrink:
            index.append(b)  # one element, the dimension dropped; negative counts from the end
        else:
            index.append(slice(None if no_begin else b, None if no_end else e, s))
    return [np.asarray(x[tuple(index)])]


def _range(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    start, limit, delta = xs
    dtype = np_dtype(op.get_attr("Tidx"))
    if np.issubdtype(dtype, np.integer):
        size = max(0, -(-(int(limit) - int(start)) // int(delta)))
    else:
        size = max(0, int(np.ceil((float(limit) - float(start)) / float(delta))))
    return [np.asarray(start + np.arange(size).astype(dtype) * delta, dtype)]  # TF: start + i*delta


def _gather(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    if op.get_attr("batch_dims"):
        raise ReplayError(f"{op.name}: GatherV2 with batch_dims != 0 is not supported")
    return [np.take(xs[0], xs[1], axis=int(xs[2]))]


def _passthrough(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    return list(xs)


def _const(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    return [tf.make_ndarray(op.get_attr("value"))]


KERNELS: dict[str, Kernel] = {
    "Identity": _passthrough, "IdentityN": _passthrough, "Snapshot": _passthrough,
    "StopGradient": _passthrough,
    "NoOp": lambda op, xs: [],
    "Const": _const, "_HostConst": _const,
    "AddV2": _elementwise(np.add), "Add": _elementwise(np.add), "AddN": _add_n,
    "Sub": _elementwise(np.subtract), "Mul": _elementwise(np.multiply),
    "RealDiv": _elementwise(_divide), "Div": _elementwise(_divide),
    "FloorDiv": _elementwise(_floor_div), "FloorMod": _elementwise(np.mod),
    "Maximum": _elementwise(np.maximum), "Minimum": _elementwise(np.minimum),
    "Neg": _elementwise(np.negative), "Cast": _cast,
    "Reshape": lambda op, xs: [np.reshape(xs[0], xs[1].tolist())],
    "Pad": _pad, "PadV2": _pad,
    "ConcatV2": lambda op, xs: [np.concatenate(xs[:-1], axis=int(xs[-1]))],
    "Pack": lambda op, xs: [np.stack(xs, axis=op.get_attr("axis"))],
    "Unpack": lambda op, xs: [np.take(xs[0], i, axis=op.get_attr("axis"))
                              for i in range(op.get_attr("num"))],
    "Split": lambda op, xs: list(np.split(xs[1], op.get_attr("num_split"), axis=int(xs[0]))),
    "SplitV": _split_v, "Slice": _slice, "StridedSlice": _strided_slice,
    "Squeeze": lambda op, xs: [np.squeeze(xs[0], tuple(op.get_attr("squeeze_dims")) or None)],
    "ExpandDims": lambda op, xs: [np.expand_dims(xs[0], int(xs[1]))],
    "Shape": lambda op, xs: [np.asarray(xs[0].shape, np_dtype(op.get_attr("out_type")))],
    "Size": lambda op, xs: [np.asarray(xs[0].size, np_dtype(op.get_attr("out_type")))],
    "Rank": lambda op, xs: [np.asarray(xs[0].ndim, np.int32)],
    "Fill": lambda op, xs: [np.full(xs[0].tolist(), xs[1], xs[1].dtype)],
    "ZerosLike": lambda op, xs: [np.zeros_like(xs[0])],
    "OnesLike": lambda op, xs: [np.ones_like(xs[0])],
    "Range": _range, "GatherV2": _gather,
    "Transpose": lambda op, xs: [np.transpose(xs[0], xs[1].tolist())],
}  # fmt: skip
"""Op type -> NumPy kernel ``(op, inputs) -> outputs``. Add entries to replay more ops."""
