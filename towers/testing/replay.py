"""Replay an all-reduce in NumPy, adding in exactly the order TensorFlow does (bitwise on CPU):
the traced graph (as eager runs it) or Grappler's (as the ``tf.function`` runs it), op by op."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.devices import local_devices
from towers.testing.kernels import KERNELS, ReplayError, np_dtype

__all__ = ["KERNELS", "ReplayError", "place", "replay", "supported_ops"]

_FED = ("Placeholder", "_Arg", "_DeviceArg")


def place(values: Sequence[Any], devices: Sequence[str]) -> list[tf.Tensor]:
    """Value i (an array, or a tensor in a graph) as a tensor on ``devices[i]``."""
    out = []
    for value, device in zip(values, devices, strict=True):
        with tf.device(device):
            out.append(tf.identity(value))
    return out


def supported_ops() -> list[str]:
    """The op types :func:`replay` can interpret, sorted (inputs ``Placeholder``/``_Arg`` too)."""
    return sorted({*KERNELS, *_FED})


def _check_transparent(graph: tf.Graph) -> None:
    opaque = sorted({op.type for op in graph.get_operations()  # the runtime orders these
                     if op.type.lstrip("_").startswith(("Collective", "Nccl"))})
    if opaque:
        raise ReplayError(f"the algorithm is opaque to replay: it uses {', '.join(opaque)}, and "
                          "TensorFlow's collective runtime decides that op's summation order, "
                          "not the graph")


def _needed(fetches: Sequence[tf.Tensor], fed: set[str]) -> set[tf.Operation]:
    """Ops the fetches depend on through data edges (control inputs are ignored)."""
    needed: set[tf.Operation] = set()
    stack = [t.op for t in fetches if t.name not in fed]
    while stack:
        op = stack.pop()
        if op not in needed:
            needed.add(op)
            stack.extend(t.op for t in op.inputs if t.name not in fed)
    return needed


def _run_kernel(op: tf.Operation, inputs: list[np.ndarray]) -> list[np.ndarray]:
    kernel = KERNELS.get(op.type)
    if kernel is None:
        raise ReplayError(f"cannot replay op type {op.type!r} (node {op.name!r}): it has no NumPy "
                          f"kernel. Supported: {', '.join(supported_ops())}. Add one to "
                          "towers.testing.replay.KERNELS.")
    try:
        outputs = kernel(op, inputs)
    except ReplayError:
        raise
    except Exception as err:
        raise ReplayError(f"replaying {op.type} {op.name!r} failed: {err}") from err
    if len(outputs) != len(op.outputs):
        raise ReplayError(f"kernel for {op.type} gave {len(outputs)} outputs, not "
                          f"{len(op.outputs)}")
    for out, tensor in zip(outputs, op.outputs, strict=True):
        if out.dtype != np_dtype(tensor.dtype) or not tensor.shape.is_compatible_with(out.shape):
            raise ReplayError(f"kernel for {op.type} ({op.name!r}) made {out.dtype}"
                              f"{list(out.shape)}; the graph says "
                              f"{tensor.dtype.name}{tensor.shape}")
    return outputs


def _interpret(graph: tf.Graph, feeds: dict[str, np.ndarray], fetches: Sequence[tf.Tensor]
               ) -> list[np.ndarray]:
    """Evaluate ``fetches`` from ``feeds`` (tensor name -> array), ops in creation order."""
    _check_transparent(graph)
    values = dict(feeds)
    needed = _needed(fetches, set(feeds))
    for op in graph.get_operations():
        if op not in needed:
            continue
        if op.type in _FED:
            raise ReplayError(f"graph input {op.name!r} ({op.type}) was not fed")
        missing = [t.name for t in op.inputs if t.name not in values]
        if missing:
            raise ReplayError(f"{op.name!r} reads {missing} before they are computed")
        outputs = _run_kernel(op, [values[t.name] for t in op.inputs])
        values.update((t.name, out) for t, out in zip(op.outputs, outputs, strict=True))
    return [values[t.name] for t in fetches]


def _captured(concrete: Any) -> list[np.ndarray]:
    try:
        return [np.asarray(external.numpy()) for external, _ in concrete.graph.captures]
    except Exception as err:  # a resource handle (variable) has no value to replay
        raise ReplayError(f"the algorithm captures a value replay cannot read: {err}") from err


def _optimized_graph(metadata: Any, n_args: int) -> tf.Graph:
    """The graph grappler made from our function (the one with ``n_args`` arguments)."""
    for function_graph in reversed(metadata.function_graphs):
        graph_def = function_graph.post_optimization_graph
        if sum(node.op in _FED for node in graph_def.node) != n_args:
            continue
        kept = {node.op for node in graph_def.node}
        later = {n.op for p in function_graph.partition_graphs for n in p.node} - kept
        later -= {"_Send", "_Recv", "_HostSend", "_HostRecv", "_Arg", "_Retval"}
        if later:
            raise ReplayError(f"TensorFlow rewrote the graph after grappler: {sorted(later)}")
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        return graph
    raise ReplayError("TensorFlow's run metadata holds no optimized graph for the algorithm")


def _replay_optimized(fn: Any, concrete: Any, arrays: list[np.ndarray], devices: Sequence[str]
                      ) -> list[np.ndarray]:
    from tensorflow.python.eager import context  # run metadata has no public API

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        fn(*place(arrays, devices))
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    args = arrays + _captured(concrete)
    graph = _optimized_graph(metadata, len(args))
    feeds: dict[str, np.ndarray] = {}
    results: dict[int, tf.Tensor] = {}
    for node in graph.get_operations():
        if node.type in _FED:
            feeds[node.outputs[0].name] = args[node.get_attr("index")]
        elif node.type in ("_Retval", "_DeviceRetval"):
            results[node.get_attr("index")] = node.inputs[0]
    return _interpret(graph, feeds, [results[i] for i in sorted(results)])


def replay(
    algorithm: Callable[..., Any], arrays: Sequence[np.ndarray], op: str = "sum", *,
    devices: Sequence[str] | None = None, optimized: bool = False,
) -> list[np.ndarray]:
    """Recompute ``algorithm(values, op=op)`` in NumPy, in exactly TensorFlow's order.

    Args:
        arrays: one array per tower, of one shape and dtype, input i on ``devices[i]``.
        optimized: interpret Grappler's graph (runs the function once), not the traced one.

    Raises:
        ReplayError: an op without a NumPy kernel (named), or an opaque collective op.
    """
    arrays = [np.asarray(a) for a in arrays]
    if not arrays:
        raise ValueError("arrays is empty: expected one array per tower")
    if devices is None:
        devices = local_devices()
    if len(devices) < len(arrays):
        raise ValueError(f"{len(arrays)} arrays but only {len(devices)} devices: call "
                         f"towers.simulate_devices({len(arrays)}) first, or pass devices=")
    devices = list(devices)[: len(arrays)]
    fn = tf.function(lambda *args: list(algorithm(place(args, devices), op=op)), autograph=False)
    concrete = fn.get_concrete_function(*[tf.TensorSpec(a.shape, a.dtype) for a in arrays])
    _check_transparent(concrete.graph)  # before anything runs or reads captured values
    if optimized:
        return _replay_optimized(fn, concrete, arrays, devices)
    graph = concrete.graph
    feeds = {p.name: a for p, a in zip(graph.inputs, arrays, strict=False)}
    captures = zip(graph.captures, _captured(concrete), strict=True)
    feeds.update({internal.name: value for (_, internal), value in captures})
    return _interpret(graph, feeds, concrete.outputs)
