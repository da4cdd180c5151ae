"""Replay an all-reduce in NumPy, adding in exactly the order TensorFlow does.

:func:`replay` traces an algorithm once in a ``tf.function`` whose inputs sit on
``n`` devices, then interprets the traced graph op by op with NumPy kernels, in
creation (topological) order. NumPy's float16/bfloat16/float32/float64
arithmetic rounds each operation exactly as TensorFlow's CPU kernels do, and no
kernel here ever upcasts, so on CPU the replay is **bitwise** equal to
TensorFlow's result: every reordered or regrouped addition shows up as a
difference. ::

    algorithm ──trace──▶ graph ──interpret──▶ NumPy arrays == TensorFlow's, bit for bit
                          Placeholder → Identity(on device i) → AddV2 → ... → outputs

Measured on TF 2.21, CPU (``tests/allreduce/test_replay.py`` pins each fact):

* **AddN's order.** The CPU ``AddN`` kernel adds up to 9 inputs strictly left to
  right, ``((x0 + x1) + x2) + ...``. With more, it adds the first ``r = n mod 8``
  inputs (8 when ``r`` is 0, 9 when ``r`` is 1) left to right, then sums each
  further block of 8 left to right and adds that block sum to the total:
  ``total + (((x_r + x_r+1) + ...) + x_r+7)``. Checked bitwise for n = 2..33
  and every float dtype with values where the order changes the result.
* **Grappler reorders sums inside a tf.function.** Eager execution runs ops as
  written. Inside a ``tf.function`` the arithmetic optimizer (1) collapses a chain
  of adds on one device (intermediates with one consumer) into one ``AddN``, and
  (2) sorts the inputs of ``AddN`` (a commutative op) by *node name*. So a sum is
  formed in the order of its inputs' names: ``a_10`` sorts before ``a_2``, and
  ``AddN([z, b, a])`` runs as ``(a + b) + z``. For towers this means: a chain
  ``((x0 + x1) + x2) ...`` over 10 or more values on one device becomes an AddN
  with AddN's block order (above), and with inputs named out of tower order the
  order changes for any n >= 3 (the names are those left after grappler drops
  identities: often the ``tf.function``'s argument names). Separately,
  constant folding turns ``x / n`` into ``x * (1/n)``: a ``mean`` over 3, 5, 6 or
  7 towers differs from eager in about a third of the elements (3363 of 10000 for
  n = 3). ``AddV2`` input swaps are harmless (IEEE addition commutes).

Hence two modes. ``replay(...)`` interprets the graph as the algorithm wrote it:
bitwise equal to eager execution. ``replay(..., optimized=True)`` runs the
function once, takes the graph grappler produced (from TensorFlow's run
metadata) and interprets that: bitwise equal to the ``tf.function`` result.

Collective ops (``CollectiveReduceV2``, ``NcclAllReduce``, ...) are opaque: the
collective decides the order, so they raise :class:`ReplayError`. Extend
:data:`KERNELS` to teach the replay another op (the kernels themselves live in
:mod:`towers.testing.kernels`; this module interprets the graph with them).

Example:
    >>> out = replay(naive, [np.ones(3, np.float32)] * 4)   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.devices import local_devices
from towers.testing.kernels import KERNELS, ReplayError, np_dtype

__all__ = ["KERNELS", "ReplayError", "is_opaque", "replay", "supported_ops"]


def is_opaque(op_type: str) -> bool:
    """True for ops whose summation order TensorFlow's runtime decides (collectives, NCCL)."""
    return op_type.lstrip("_").startswith(("Collective", "Nccl"))


_FED = ("Placeholder", "_Arg", "_DeviceArg")


def supported_ops() -> list[str]:
    """The op types :func:`replay` can interpret, sorted (inputs ``Placeholder``/``_Arg`` too)."""
    return sorted({*KERNELS, *_FED})


def _check_transparent(graph: tf.Graph) -> None:
    opaque = sorted({op.type for op in graph.get_operations() if is_opaque(op.type)})
    if opaque:
        raise ReplayError(
            f"the algorithm is opaque to replay: it uses {', '.join(opaque)}, and TensorFlow's "
            "collective runtime decides that op's summation order, not the graph"
        )


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
    if is_opaque(op.type):
        _check_transparent(op.graph)
    kernel = KERNELS.get(op.type)
    if kernel is None:
        raise ReplayError(
            f"cannot replay op type {op.type!r} (node {op.name!r}): it has no NumPy kernel. "
            f"Supported: {', '.join(supported_ops())}. Add one to towers.testing.replay.KERNELS."
        )
    try:
        outputs = kernel(op, inputs)
    except ReplayError:
        raise
    except Exception as err:
        raise ReplayError(f"replaying {op.type} {op.name!r} failed: {err}") from err
    if len(outputs) != len(op.outputs):
        raise ReplayError(
            f"kernel for {op.type} gave {len(outputs)} outputs, not {len(op.outputs)}"
        )
    for out, tensor in zip(outputs, op.outputs, strict=True):
        if out.dtype != np_dtype(tensor.dtype) or not tensor.shape.is_compatible_with(out.shape):
            raise ReplayError(
                f"kernel for {op.type} ({op.name!r}) made {out.dtype}{list(out.shape)}; "
                f"the graph says {tensor.dtype.name}{tensor.shape}"
            )
    return outputs


def _interpret(
    graph: tf.Graph, feeds: dict[str, np.ndarray], fetches: Sequence[tf.Tensor]
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


def _placed(algorithm: Callable[..., Any], op: str, devices: Sequence[str]) -> Callable[..., Any]:
    """``algorithm`` behind a function of plain inputs that pins input i to ``devices[i]``."""

    def placed(*args: tf.Tensor) -> list[tf.Tensor]:
        values = []
        for arg, device in zip(args, devices, strict=True):
            with tf.device(device):
                values.append(tf.identity(arg))
        return list(algorithm(values, op=op))

    return placed


def _captured(concrete: Any) -> list[np.ndarray]:
    try:
        return [np.asarray(external.numpy()) for external, _ in concrete.graph.captures]
    except Exception as err:  # a resource handle (variable) has no value to replay
        raise ReplayError(f"the algorithm captures a value replay cannot read: {err}") from err


def _replay_traced(concrete: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
    graph = concrete.graph
    feeds = {p.name: a for p, a in zip(graph.inputs, arrays, strict=False)}
    captures = zip(graph.captures, _captured(concrete), strict=True)
    feeds.update({internal.name: value for (_, internal), value in captures})
    return _interpret(graph, feeds, concrete.outputs)


def _run_with_metadata(fn: Any, inputs: list[tf.Tensor]) -> Any:
    from tensorflow.python.eager import context  # run metadata has no public API

    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        fn(*inputs)
        return ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()


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


def _replay_optimized(
    fn: Any, concrete: Any, arrays: list[np.ndarray], devices: Sequence[str]
) -> list[np.ndarray]:
    inputs = []
    for array, device in zip(arrays, devices, strict=True):
        with tf.device(device):
            inputs.append(tf.identity(tf.constant(array)))
    metadata = _run_with_metadata(fn, inputs)
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
    algorithm: Callable[..., Any],
    arrays: Sequence[np.ndarray],
    op: str = "sum",
    *,
    devices: Sequence[str] | None = None,
    optimized: bool = False,
) -> list[np.ndarray]:
    """Recompute ``algorithm(values, op=op)`` in NumPy, in exactly TensorFlow's order.

    Args:
        algorithm: an all-reduce written with plain TensorFlow ops (see the module docstring).
        arrays: one array per tower, all of one shape and dtype.
        op: passed to the algorithm (``"sum"``, ``"mean"``, ``"max"``, ``"min"``).
        devices: where input i lives (default: ``towers.local_devices()[:n]``).
        optimized: interpret the graph grappler produced instead of the traced one; this
            runs the function once. Default ``False`` matches eager execution.

    Returns:
        One array per algorithm output, each of the input dtype; on CPU bitwise equal to
        TensorFlow's results (eager ones, or the ``tf.function`` ones when ``optimized``).

    Raises:
        ReplayError: an op without a NumPy kernel (the message names it and lists the
            supported ops), or an opaque collective op.
        ValueError: no arrays, or fewer devices than arrays.

    Example:
        >>> big = np.float32([1e8])
        >>> replay(naive, [big, np.float32([1]), -big])   # doctest: +SKIP
        [array([0.], dtype=float32), array([0.], dtype=float32), array([0.], dtype=float32)]
    """
    arrays = [np.asarray(a) for a in arrays]
    if not arrays:
        raise ValueError("arrays is empty: expected one array per tower")
    if devices is None:
        devices = local_devices()
    if len(devices) < len(arrays):
        raise ValueError(
            f"{len(arrays)} arrays but only {len(devices)} devices: call "
            f"towers.simulate_devices({len(arrays)}) first, or pass devices="
        )
    devices = list(devices)[: len(arrays)]
    fn = tf.function(_placed(algorithm, op, devices), autograph=False)
    concrete = fn.get_concrete_function(*[tf.TensorSpec(a.shape, a.dtype) for a in arrays])
    _check_transparent(concrete.graph)  # before anything runs or reads captured values
    if optimized:
        return _replay_optimized(fn, concrete, arrays, devices)
    return _replay_traced(concrete, arrays)
