"""Replay an all-reduce in NumPy, adding in exactly the order TensorFlow does (bitwise on CPU):
the traced graph (as eager runs it) or Grappler's (as the ``tf.function`` runs it), op by op,
each op type by a NumPy kernel that rounds as TF's CPU kernel does."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.devices import local_devices

__all__ = ["KERNELS", "Kernel", "ReplayError", "place", "replay"]

Kernel = Callable[[tf.Operation, list[np.ndarray]], list[np.ndarray]]
_FED = ("Placeholder", "_Arg", "_DeviceArg")


class ReplayError(RuntimeError):
    """The graph holds an op the replay cannot follow (unknown, or opaque)."""


def _np_dtype(dtype: tf.DType) -> np.dtype:
    """The NumPy dtype of a TensorFlow dtype (bfloat16 included)."""
    return np.dtype(tf.as_dtype(dtype).as_numpy_dtype)


def place(values: Sequence[Any], devices: Sequence[str]) -> list[tf.Tensor]:
    """Value i (an array, or a tensor in a graph) as a tensor on ``devices[i]``."""
    out = []
    for value, device in zip(values, devices, strict=True):
        with tf.device(device):
            out.append(tf.identity(value))
    return out


def _check_transparent(graph: tf.Graph) -> None:
    opaque = sorted({op.type for op in graph.get_operations()  # the runtime orders these
                     if op.type.lstrip("_").startswith(("Collective", "Nccl"))})
    if opaque:
        raise ReplayError(f"the algorithm is opaque to replay: it uses {', '.join(opaque)}, and "
                          "TensorFlow's collective runtime decides that op's summation order, "
                          "not the graph")


def _interpret(graph: tf.Graph, feeds: dict[str, np.ndarray], fetches: Sequence[tf.Tensor]
               ) -> list[np.ndarray]:
    """Evaluate ``fetches`` from ``feeds`` (tensor name -> array), ops in creation order, each
    by its kernel in :data:`KERNELS`, checking what it makes against the graph."""
    values = dict(feeds)
    needed: set[tf.Operation] = set()  # what the fetches read through data edges, not control
    stack = [t.op for t in fetches if t.name not in feeds]
    while stack:
        op = stack.pop()
        if op not in needed:
            needed.add(op)
            stack.extend(t.op for t in op.inputs if t.name not in feeds)
    for op in [op for op in graph.get_operations() if op in needed]:
        if op.type in _FED:
            raise ReplayError(f"graph input {op.name!r} ({op.type}) was not fed")
        missing = [t.name for t in op.inputs if t.name not in values]
        if missing:
            raise ReplayError(f"{op.name!r} reads {missing} before they are computed")
        kernel = KERNELS.get(op.type)
        if kernel is None:
            raise ReplayError(f"cannot replay op type {op.type!r} (node {op.name!r}): it has no "
                              f"NumPy kernel. Supported: {', '.join(sorted({*KERNELS, *_FED}))}. "
                              "Add one to towers.testing.replay.KERNELS.")
        try:
            outputs = kernel(op, [values[t.name] for t in op.inputs])
        except ReplayError:
            raise
        except Exception as err:
            raise ReplayError(f"replaying {op.type} {op.name!r} failed: {err}") from err
        if len(outputs) != len(op.outputs):
            raise ReplayError(f"kernel for {op.type} gave {len(outputs)} outputs, not "
                              f"{len(op.outputs)}")
        for out, t in zip(outputs, op.outputs, strict=True):
            if out.dtype != _np_dtype(t.dtype) or not t.shape.is_compatible_with(out.shape):
                raise ReplayError(f"kernel for {op.type} ({op.name!r}) made {out.dtype}"
                                  f"{list(out.shape)}; the graph says {t.dtype.name}{t.shape}")
            values[t.name] = out
    return [values[t.name] for t in fetches]


def _captured(concrete: Any) -> list[np.ndarray]:
    try:
        return [np.asarray(external.numpy()) for external, _ in concrete.graph.captures]
    except Exception as err:  # a resource handle (variable) has no value to replay
        raise ReplayError(f"the algorithm captures a value replay cannot read: {err}") from err


def _replay_optimized(fn: Any, concrete: Any, arrays: list[np.ndarray], devices: Sequence[str]
                      ) -> list[np.ndarray]:
    """Run ``fn`` once and interpret the graph Grappler made of it (the one taking our args)."""
    from tensorflow.python.eager import context  # run metadata has no public API

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        fn(*place(arrays, devices))
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    args = arrays + _captured(concrete)
    for function_graph in reversed(metadata.function_graphs):
        graph_def = function_graph.post_optimization_graph
        if sum(node.op in _FED for node in graph_def.node) == len(args):
            break
    else:
        raise ReplayError("TensorFlow's run metadata holds no optimized graph for the algorithm")
    later = {n.op for p in function_graph.partition_graphs for n in p.node}
    later -= {node.op for node in graph_def.node}
    later -= {"_Send", "_Recv", "_HostSend", "_HostRecv", "_Arg", "_Retval"}
    if later:
        raise ReplayError(f"TensorFlow rewrote the graph after grappler: {sorted(later)}")
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    feeds: dict[str, np.ndarray] = {}
    results: dict[int, tf.Tensor] = {}
    for node in graph.get_operations():
        if node.type in _FED:
            feeds[node.outputs[0].name] = args[node.get_attr("index")]
        elif node.type in ("_Retval", "_DeviceRetval"):
            results[node.get_attr("index")] = node.inputs[0]
    return _interpret(graph, feeds, [results[i] for i in sorted(results)])


def replay(algorithm: Callable[..., Any], arrays: Sequence[np.ndarray], op: str = "sum", *,
           devices: Sequence[str] | None = None, optimized: bool = False) -> list[np.ndarray]:
    """Recompute ``algorithm(values, op=op)`` in NumPy, in exactly TensorFlow's order, from
    ``arrays`` (one per tower, of one shape and dtype, input i on ``devices[i]``);
    ``optimized``: interpret Grappler's graph (runs the function once), not the traced one.

    Raises:
        ReplayError: an op without a NumPy kernel (named), or an opaque collective op.
    """
    arrays = [np.asarray(a) for a in arrays]
    if not arrays:
        raise ValueError("arrays is empty: expected one array per tower")
    devices = local_devices() if devices is None else devices
    if len(devices) < len(arrays):
        raise ValueError(f"{len(arrays)} arrays but only {len(devices)} devices: call "
                         f"towers.simulate_devices({len(arrays)}) first, or pass devices=")
    devices = list(devices)[: len(arrays)]
    fn = tf.function(lambda *args: list(algorithm(place(args, devices), op=op)), autograph=False)
    concrete = fn.get_concrete_function(*[tf.TensorSpec(a.shape, a.dtype) for a in arrays])
    _check_transparent(concrete.graph)  # before anything runs or reads captured values
    if optimized:
        return _replay_optimized(fn, concrete, arrays, devices)
    graph = concrete.graph  # its inputs: the arguments, then the captured tensors
    feeds = {t.name: a for t, a in zip(graph.inputs, arrays + _captured(concrete), strict=True)}
    return _interpret(graph, feeds, concrete.outputs)


def _elementwise(fn: Callable[..., Any]) -> Kernel:
    def kernel(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
        with np.errstate(all="ignore"):
            return [np.asarray(fn(*xs))]

    return kernel


def _add_n(op: tf.Operation, xs: list[np.ndarray]) -> list[np.ndarray]:
    # <= 9 inputs left to right; else a head of n mod 8 (8 for 0, 9 for 1), then
    # `total + (block of 8, left to right)`, as TF's CPU AddN kernel
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
        return [xs[0].astype(_np_dtype(op.get_attr("DstT")))]


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
    dtype = _np_dtype(op.get_attr("Tidx"))
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
    "StopGradient": _passthrough, "NoOp": lambda op, xs: [],
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
    "Shape": lambda op, xs: [np.asarray(xs[0].shape, _np_dtype(op.get_attr("out_type")))],
    "Size": lambda op, xs: [np.asarray(xs[0].size, _np_dtype(op.get_attr("out_type")))],
    "Rank": lambda op, xs: [np.asarray(xs[0].ndim, np.int32)],
    "Fill": lambda op, xs: [np.full(xs[0].tolist(), xs[1], xs[1].dtype)],
    "ZerosLike": lambda op, xs: [np.zeros_like(xs[0])],
    "OnesLike": lambda op, xs: [np.ones_like(xs[0])],
    "Range": _range, "GatherV2": _gather,
    "Transpose": lambda op, xs: [np.transpose(xs[0], xs[1].tolist())],
}  # fmt: skip
"""Op type -> NumPy kernel ``(op, inputs) -> outputs``. Add entries to replay more ops."""
