"""How a trainer's step is compiled: its ``tf.function`` layout, in one place.

::

    trainer.train_step(x, y, w)  /  train_step_shards(shards)
          │  CompiledStep.steps[outputs]: one function per "return the outputs?";
          │  the input signature tells a batch (x, y, w) from shards (shards,)
          ▼
    forward_graph="default"  PhasedStep                       forward_graph="as_written"
      forward(*inputs): split → forward_backward               one tf.function: all four
        (the caller's Grappler settings: tf.distribute's         phases, traced and run
         replicas' kernels)                                      under as_written()
      update(grads): guard ⟨reduce → apply⟩ as_written()
        nested call op (CPUs: one call) or a second call (GPUs)

    CompiledStep.relaxed: TowerModel.fit's step, traced with the batch dimension unknown
    (RelaxedBatch) as Keras traces its own ``train_function``.

Grappler's arithmetic optimizer and constant folding reorder sums
(:mod:`towers.allreduce.machinery.base`), so the reduction always runs as written, and
the update too unless ``semantics="mirrored"`` (:func:`towers.guard.semantics.strategy_rewrites`);
the towers' kernels compile under the caller's settings by default, which
makes their gradients MirroredStrategy's bitwise on real Keras models (docs/bounds.md).
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from towers.allreduce.machinery.base import as_written
from towers.allreduce.machinery.primitives import Recorder, record
from towers.compile.relaxed import RelaxedBatch
from towers.split import concat
from towers.tower import Gradients, TowerResult, static_dense_shapes

__all__ = ["FORWARD_GRAPHS", "CompiledStep", "PhasedStep", "nests"]

FORWARD_GRAPHS = ("default", "as_written")
"""``forward_graph``: :class:`PhasedStep` (the towers under the caller's Grappler settings,
the reduction and update as written; on CPUs one call per step, on GPUs two) or the
whole step in one function
as written (a tower's gradient then equals an *eager* computation's, several hundred ULPs
from MirroredStrategy's where a gradient cancels: for references run ``as_written()``)."""


class CompiledStep:
    """A trainer's step functions (its four phases traced; ``retrace`` makes new ones).

    Attributes:
        steps: ``{outputs: step}``: the step returning the loss, or ``(loss, outputs)``.
        relaxed: the ``(loss, outputs)`` step traced with the batch dimension unknown.
        whole: ``{outputs: tf.function}``: the four phases in one function (the
            ``"as_written"`` form; ``trainer.step_function`` traces it in either form).
        nested: the update is a call op inside the step (all devices are CPUs).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.forward_stats = trainer, Recorder()
        self.nested = nests((*trainer.devices, trainer.parameter_device))
        # No reduce_retracing: a static batch size gives static shard sizes (empty towers
        # are skipped at trace time); a new batch size costs one more trace.
        self.whole = {o: self._function(o) for o in (False, True)}
        self.steps = {o: self._make(o, self.whole[o]) for o in (False, True)}
        self.relaxed = RelaxedBatch(self._make(True, self._function(True)))  # its own

    def _function(self, outputs: bool) -> Any:
        return tf.function(functools.partial(self.run_whole, outputs=outputs), autograph=False)

    def _make(self, outputs: bool, whole: Any) -> Any:
        if self.trainer.options.forward_graph == "as_written":
            return _AsWritten(whole)
        return PhasedStep(functools.partial(self.forward, outputs=outputs), self.update,
                          with_outputs=outputs, nested=self.nested)  # fmt: skip

    def _phases(self, inputs: tuple[Any, ...], outputs: bool) -> tuple[Gradients, Any]:
        """Split and forward_backward; the towers' outputs concatenated (or None)."""
        trainer = self.trainer
        trainer.trace_count += 1
        with tf.name_scope("split"):  # name scopes: the profiler's phases (bench.phases)
            shards = inputs[0] if len(inputs) == 1 else trainer.split(*inputs)
        grads = trainer.forward_backward(shards)
        if not outputs:
            return grads, None
        return grads, concat([r.outputs for r in grads.towers], trainer.parameter_device)

    def run_whole(self, *inputs: Any, outputs: bool) -> Any:
        """The four phases in one graph: ``(x, y, w)`` or ``(shards,)`` in, the loss out."""
        with record() as recorder:
            grads, concatenated = self._phases(inputs, outputs)
            with tf.name_scope("guard"):
                loss = self.trainer.reduce_and_apply(grads)
        self.trainer.last_trace_stats = recorder
        return (loss, concatenated) if outputs else loss

    def forward(self, *inputs: Any, outputs: bool) -> tuple[Gradients, Any]:
        """:class:`PhasedStep`'s forward: split and forward_backward. The towers' model
        outputs are not handed over (every tensor crossing into the update costs its call)."""
        with record() as recorder:
            grads, concatenated = self._phases(inputs, outputs)
        self.forward_stats = recorder
        # a state value no tower pass assigned goes as None (a tf.function would turn the
        # Python ``changed`` flags into tensors); the update's _as_received undoes it
        handed = tuple(r if r.changed is None else r._replace(
            non_trainable=[None if c is False else v for v, c in zip(r.non_trainable, r.changed)],
            changed=None) for r in grads.towers)  # fmt: skip
        return Gradients(tuple(r._replace(outputs=None) for r in handed)), concatenated

    def update(self, grads: Gradients) -> tf.Tensor:
        """:class:`PhasedStep`'s update: the guard's reduce and apply, as in the step."""
        trainer = self.trainer
        with tf.name_scope("forward_backward"):  # the towers' results, handed over (profiler)
            handed = Gradients(tuple(_as_received(r, trainer.replicas.replica_of(i))
                                     for i, r in enumerate(grads.towers)))  # fmt: skip
            grads = handed.on_devices(trainer.devices)  # arguments come without a device
        # Nested, the arguments arrive on the call op's device and the guard checks them
        # there: checks pinned to the towers' devices would add one partition per device
        # to the nested function, each an executor run per step (docs/performance.md).
        with record() as recorder, tf.name_scope("guard"):
            loss = trainer.reduce_and_apply(grads, handed.towers if self.nested else None)
        trainer.last_trace_stats = Recorder(self.forward_stats.transfers + recorder.transfers)
        return loss


class _AsWritten:
    """A ``tf.function`` traced and run under :func:`as_written` (``"as_written"``)."""

    def __init__(self, function: Any) -> None:
        self.function = function

    def __call__(self, *inputs: Any) -> Any:
        with as_written():
            return self.function(*inputs)

    def get_concrete_function(self, *inputs: Any) -> Any:
        with as_written():
            return self.function.get_concrete_function(*inputs)


class PhasedStep:
    """A step whose towers compile under the caller's settings and whose reduction and
    update run :func:`as_written` (``forward_graph="default"``), in one of two forms::

        nested=True: one call per step            nested=False: two calls per step
        step (tf.function, caller's settings)     forward(*inputs) -> grads, outputs
        ├── forward(*inputs) -> grads, outputs    with as_written():
        └── update(grads) -> loss                     update(grads) -> loss
            (call op, _noinline, traced
             as_written: its config_proto)

    A call op carries the config its caller traced it under (``config_proto``), and
    TensorFlow optimizes a function that is not inlined with that config: nested, the
    update keeps its stated order inside one ``tf.function`` call, also inside a caller's
    own. A nested call's tensor arguments are handed to the call op's device first: a
    pointer between CPU devices, a copy between GPUs, so a trainer nests only when all
    its devices are CPUs (:func:`nests`).

    Args:
        forward: ``(*inputs) -> (grads, outputs)``: the split and the towers.
        update: ``grads -> loss``, the reduction and the update.
        with_outputs: return ``(loss, outputs)`` instead of the loss.
        nested: one call per step (True) or two (False).
        barrier: False traces the update *into* the step under the caller's settings
            (Grappler may reorder its sums): a calibration ``towers bench --sections
            guard`` times beside the nested form, never a trainer's form (nested only).
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
        # Grappler's memory optimizer off in the update's call op: its scheduling pass
        # rewrites an AddN with inputs alive at the estimated peak into one AssignAdd per
        # input, added in arrival order (a reduction's stated order lost). The eager
        # context has no switch for that pass, so the call op's config_proto gets it.
        for op in graph.get_operations()[made:]:
            if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
                config = config_pb2.ConfigProto()
                config.ParseFromString(op.get_attr("config_proto"))
                config.graph_options.rewrite_options.memory_optimization = (
                    rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
                op._set_attr("config_proto",
                             attr_value_pb2.AttrValue(s=config.SerializeToString()))
        return (loss, outputs) if self.with_outputs else loss

    def __call__(self, *inputs: Any) -> Any:
        if self.nested:
            return self.step(*inputs)
        # The update's concrete function is the forward's partner, found once: calling
        # it directly skips tf.function's matching of every tower's gradients against
        # its signatures.
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


def nests(devices: Any) -> bool:
    """Whether a :class:`PhasedStep` over ``devices`` should be one call: all are CPUs
    (their tensors share the host's memory, so a nested call's arguments move by pointer).

    Example:
        >>> nests(["/cpu:0", "/cpu:1"]), nests(["/gpu:0", "/gpu:1"])
        (True, False)
    """
    return all((tf.DeviceSpec.from_string(d).device_type or "").upper() == "CPU"
               for d in devices)  # fmt: skip


def _as_received(result: TowerResult, replica: Any) -> TowerResult:
    """A tower's result as the update receives it, with what the one-function step knows:
    the forward's None for unassigned state undone (the variable's value, nothing assigned
    it since the forward read it; ``changed`` False), and each ``IndexedSlices``'s
    ``dense_shape`` (an argument's is a tensor of unknown value) its variable's static shape."""
    if any(v is None for v in result.non_trainable):
        with tf.device(replica.device):
            values = [tf.convert_to_tensor(var.value) if v is None else v for v, var
                      in zip(result.non_trainable, replica.model.non_trainable_variables)]
        changed = tuple(v is not None for v in result.non_trainable)
        result = result._replace(non_trainable=values, changed=changed)
    return result._replace(grads=static_dense_shapes(result.grads,
                                                     replica.model.trainable_variables))
