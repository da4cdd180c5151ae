"""Keep TensorFlow from reordering our additions: run graphs *as written*.

Inside a ``tf.function``, Grappler's arithmetic optimizer rewrites trees of
``Add``/``AddN`` on one device into a single ``AddN`` with its inputs in an order
of its choosing, and constant folding turns ``x / n`` into ``x * (1/n)``. Both
change float results by a few ULPs (measured on TF 2.21: a 6-tower ``add_n``
differed from its eager result by 2 ULPs after Grappler absorbed tower 0's
gradient ``AddN`` into it; a mean was off by one ULP). For a library whose
point is to add in a *stated* order, and to replay that order in NumPy, that is
not acceptable, so towers runs its reduction and update inside :func:`as_written`
— and only those by default: the towers' forward/backward compile under the caller's
settings, as tf.distribute's replicas do (:data:`FORWARD_GRAPHS`, :class:`PhasedStep`).

The switch is TensorFlow's process-wide optimizer setting; :func:`as_written`
sets it around a call and restores it after, so other code keeps Grappler's
defaults. The cost is small: these rewrites save a handful of element-wise ops.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

__all__ = ["FORWARD_GRAPHS", "REWRITES", "PhasedStep", "as_written", "nests", "replica_scope",
           "scoped_tower"]

REWRITES = ("arithmetic_optimization", "constant_folding")
"""The Grappler passes that change the order or form of floating-point arithmetic."""


@contextlib.contextmanager
def as_written() -> Iterator[None]:
    """Run ``tf.function`` calls in the block without the reordering Grappler passes.

    Example:
        >>> with as_written():                  # doctest: +SKIP
        ...     out = my_function(x)
    """
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({name: False for name in REWRITES})
    try:
        yield
    finally:
        # None restores TensorFlow's default for a pass nobody had set.
        tf.config.optimizer.set_experimental_options({name: before.get(name) for name in REWRITES})


FORWARD_GRAPHS = ("default", "as_written")
"""How a trainer compiles its step (``TowerTrainer(forward_graph=...)``):

``"default"``: :class:`PhasedStep`. The towers' forward/backward (and the split)
compile under the caller's Grappler settings — TensorFlow's defaults unless changed,
the settings tf.distribute's replica step compiles under — and only the reduction and
the update under :func:`as_written`: a nested function in the step's one call on CPU
devices, a second call on GPUs (:func:`nests`).
The towers' gradients are then bitwise those of ``MirroredStrategy``'s replicas on
real Keras models (BatchNorm after linear convolutions, depthwise convolutions,
attention with LayerNorm: measured, docs/bounds.md), and the reduction keeps its
stated order. Cost on CPUs: none, the step is one call (medians of 100 interleaved
rounds at 2 CPU towers: 0.41 ms against ``"as_written"``'s 0.45 ms on a small dense
model, 1.16 against 1.17 ms with conv + BatchNorm); the two-call form GPUs get costs
+0.4 to +0.65 ms there (0.83, 1.80 ms), mostly the Python dispatch of the towers'
results into the second call (docs/bounds.md §4).

``"as_written"``: the whole step in one ``tf.function`` under :func:`as_written`.
One call and one graph, but Grappler's passes are off for the towers' kernels too,
so a tower's gradient equals an *eager* computation's, not a default
``tf.function``'s: several hundred ULPs from MirroredStrategy's where a gradient
cancels (a convolution's bias before BatchNorm), and Adam turns those into
full-size steps. Use it to compare with a reference that is itself run
``as_written()``, or where one graph per step matters.
"""


class PhasedStep:
    """A step whose towers compile under the caller's settings and whose reduction and
    update run :func:`as_written` (``forward_graph="default"``), in one of two forms::

        nested=True: one call per step            nested=False: two calls per step
        step (tf.function, caller's settings)     forward(*inputs) -> grads, outputs
        ├── forward(*inputs) -> grads, outputs    with as_written():
        └── update(grads) -> loss                     update(grads) -> loss
            (call op, _noinline, traced
             as_written: its config_proto)

    TensorFlow's optimizer options are per process, but a call op carries the config
    its caller traced it under (``config_proto``), and TensorFlow instantiates, and so
    optimizes, a function that is not inlined with that config. Nested, the update
    keeps its stated order inside a step that is one ``tf.function`` call — also inside
    a caller's own ``tf.function``. The price: a nested call's tensor arguments are
    handed to the call op's device first (TensorFlow's ``PartitionedCall``; only
    resource handles stay put). Between CPU devices of one process that is a pointer;
    between GPUs it would be a copy of every gradient, so a trainer nests only when
    all its devices are CPUs (:func:`nests`) and otherwise makes two calls, whose
    arguments stay where they are.

    Args:
        forward: ``(*inputs) -> (grads, outputs)``: the split and the towers.
        update: ``grads -> loss``, the reduction and the update.
        with_outputs: return ``(loss, outputs)`` instead of the loss.
        nested: one call per step (True) or two (False).
        barrier: False traces the update *into* the step, under the caller's settings:
            no call op, no as-written, so Grappler may reorder its sums. A control for
            tests of the barrier, never a trainer's form (nested only).
    """

    def __init__(self, forward: Any, update: Any, with_outputs: bool = False,
                 nested: bool = True, barrier: bool = True) -> None:  # fmt: skip
        if not (nested or barrier):
            raise ValueError("barrier=False needs nested=True (one call with the update inside)")
        self.with_outputs, self.nested, self.barrier = with_outputs, nested, barrier
        self.update = tf.function(update, autograph=False,
                                  experimental_attributes={"_noinline": True})  # fmt: skip
        if nested:
            self.forward = forward
            self.step = tf.function(self._step, autograph=False)
        else:
            self.forward = tf.function(forward, autograph=False)
            self._updates: dict[Any, Any] = {}  # the forward's concrete function -> update's

    def _step(self, *inputs: Any) -> Any:
        grads, outputs = self.forward(*inputs)
        if not self.barrier:  # the calibration: update ops among the towers', Grappler's
            loss = self.update.python_function(grads)
            return (loss, outputs) if self.with_outputs else loss
        graph = tf.compat.v1.get_default_graph()
        made = len(graph.get_operations())
        with as_written():  # read when the call op is made: it goes into its config_proto
            loss = self.update(grads)
        for op in graph.get_operations()[made:]:
            if op.type in _CALLS:
                _keep_sums(op)
        return (loss, outputs) if self.with_outputs else loss

    def __call__(self, *inputs: Any) -> Any:
        if self.nested:
            return self.step(*inputs)
        # The update's concrete function is the forward's partner, found once: calling
        # it directly skips tf.function's matching of every tower's gradients against
        # its signatures (measured 1.9 -> 1.2 ms per step on conv-MNIST, 4 towers).
        update = self._updates[self.get_concrete_function(*inputs)]
        grads, outputs = self.forward(*inputs)
        with as_written():
            loss = update(grads)
        return (loss, outputs) if self.with_outputs else loss

    def get_concrete_function(self, *inputs: Any) -> Any:
        """Trace (or find) the step for these inputs (two calls: the forward's)."""
        if self.nested:
            return self.step.get_concrete_function(*inputs)
        forward = self.forward.get_concrete_function(*inputs)
        if forward not in self._updates:
            with as_written():
                self._updates[forward] = self.update.get_concrete_function(
                    forward.structured_outputs[0])
        return forward


_CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def _keep_sums(call: tf.Operation) -> None:
    """Turn Grappler's memory optimizer off in ``call``'s ``config_proto``.

    Its scheduling pass rewrites an ``AddN`` with more than two inputs, some alive at
    the device's estimated peak memory, into a temporary variable and one ``AssignAdd``
    per input, added in whatever order the inputs arrive: a reduction's stated order
    lost, and 1.6× its thread time (measured on the wide MLP's 4-tower sum once the
    guard's checks sat beside it). The eager context has no switch for that pass, so
    the nested update's call op gets it directly (the two-call form and
    ``forward_graph="as_written"`` keep TensorFlow's default there).
    """
    config = config_pb2.ConfigProto()
    config.ParseFromString(call.get_attr("config_proto"))
    config.graph_options.rewrite_options.memory_optimization = (
        rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
    call._set_attr("config_proto", attr_value_pb2.AttrValue(s=config.SerializeToString()))


def nests(devices: Any) -> bool:
    """Whether a :class:`PhasedStep` over ``devices`` should be one call: all are CPUs
    (their tensors share the host's memory, so a nested call's arguments move by pointer).

    Example:
        >>> nests(["/cpu:0", "/cpu:1"]), nests(["/gpu:0", "/gpu:1"])
        (True, False)
    """
    return all((tf.DeviceSpec.from_string(d).device_type or "").upper() == "CPU"
               for d in devices)  # fmt: skip


_REPLICA = re.compile(r"replica_(\d+)$")


def replica_scope(tower: int) -> Any:
    """The name scope of tower ``tower``'s ops: the names ``MirroredStrategy`` gives its
    replicas (replica 0 in the caller's scope, replica ``i`` under ``replica_<i>/``).

    Names are not cosmetic. Grappler's arithmetic optimizer and constant folding rewrite
    two graphs that differ only in their node names differently (measured on TF 2.21:
    Conv2D → ``hard_swish`` → pooling → Dense, one device, the same tape step with and
    without a name scope around it: the conv kernel's gradient differs in its last bits).
    Named like the strategy's replicas, every tower's kernels are the strategy's:
    ``keras.applications.MobileNetV3Small`` fits bitwise as under ``MirroredStrategy``
    (tests/model/test_equality.py; its hard_swish block: test_ordering.py); under
    ``tower_<i>`` scopes its conv kernels differed in their last bits after one step.
    Tower 0's ops therefore carry no scope of their own (:func:`scoped_tower`).
    """
    return contextlib.nullcontext() if tower == 0 else tf.name_scope(f"replica_{tower}")


def scoped_tower(op_name: str) -> int | None:
    """The tower ``i > 0`` whose :func:`replica_scope` an op's name carries, else None
    (tower 0's ops, like any op outside a tower, carry none).

    Example:
        >>> scoped_tower("gradient_tape/replica_2/dense/MatMul"), scoped_tower("dense/MatMul")
        (2, None)
    """
    for part in op_name.split("/")[:-1]:
        match = _REPLICA.match(part)
        if match:
            return int(match.group(1))
    return None
