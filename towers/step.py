"""``TowerTrainer``: one synchronous data-parallel step, in four public phases.

::

    shards  = trainer.split(x, y, sample_weight)   batch ─▶ shard_0 … shard_{n-1}
    grads   = trainer.forward_backward(shards)     tower i: tf.device(d_i), tape, loss / B_global
    reduced = trainer.reduce(grads)                all-reduce; combine state; sum the loss
    trainer.apply(reduced)                         the optimizer, on every replica

``train_step_shards(shards)`` is the step without its split, for a batch the per-device
input pipeline already cut and placed (:func:`towers.split.distribute`).
``train_step`` is exactly these four calls, traced once per input signature: split and
forward_backward under the caller's Grappler settings (the kernels tf.distribute's
replicas run), reduce and apply in a nested function traced
:func:`towers.allreduce.machinery.ordering.as_written` so additions happen in the order the
code states — one ``tf.function`` call per step on CPUs, two on GPUs
(``ordering.PhasedStep``; ``forward_graph="as_written"``: all four in one function run
so, see ``ordering.FORWARD_GRAPHS``); ``reduce`` and ``apply`` sit inside the
non-finite guard's one ``tf.cond`` (:mod:`towers.guard.nonfinite`), so a step with a
NaN or Inf on any tower changes nothing. A teacher can call the phases one at a time:
each in its own ``tf.function`` under ``as_written()``, they give bitwise the step's
loss, weights and optimizer state (eagerly too with Grappler's ``remapping`` off: a
fused MatMul+BiasAdd rounds differently; see the README). Collective-op algorithms
(``nccl``) need a ``tf.function``: their ops on every device must start together.

Where variables live is the :class:`~towers.placement.Placement`: ``parameter_device``
applies once on the parameter device, ``replicated`` on every tower's copy.
Non-trainable state (BatchNormalization's moving statistics) is combined explicitly,
because Keras 3 under MirroredStrategy lets each replica's copy drift (see the
project's docs): ``semantics="one_device"`` (default) averages the towers' updates over
the towers that saw examples, so every copy stays identical; ``"mirrored"`` keeps
tower 0's update, reproducing what MirroredStrategy shows when read
(:mod:`towers.guard.semantics`). Integer state (dropout seed counters) advances
identically on every tower; tower 0's is kept.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.ordering import (
    PhasedStep,
    as_written,
    nests,
    replica_scope,
)
from towers.allreduce.machinery.primitives import Recorder, record, send
from towers.allreduce.machinery.recording import StepStats
from towers.allreduce.machinery.reducer import as_reducer, resolve
from towers.guard import capabilities
from towers.guard.arguments import check_bool
from towers.guard.deadline import Deadline, settled
from towers.guard.inputs import batch_tensors, check_batch_against_model, check_kinds, naming
from towers.guard.loss_scale import LossScale, is_loss_scaled
from towers.guard.nonfinite import Guard, sums_exactly
from towers.guard.options import TowerOptions
from towers.guard.reduces import check_sums
from towers.guard.replicas import ReplicaCheck
from towers.guard.semantics import check_semantics, clip_share, tower_divisor, unclipped
from towers.guard.trainable import TrainableWatch
from towers.placement import (
    PLACEMENTS,
    ModelLike,
    OptimizerLike,
    Replica,
    check_devices,
    check_weights,
    get_placement,
    read_weights,
    variable_values,
)
from towers.split import Shards, concat, shard_batch, shard_sizes
from towers.tower import (
    Gradients,
    TowerResult,
    combine_non_trainable,
    empty_tower_step,
    tower_step,
)
from towers.training.keras_loss import LossFn, loss_divisor, resolve_loss
from towers.training.losses import OutputLosses, is_structured, reduction_of
from towers.training.shapes import RelaxedBatch, relaxes

__all__ = ["PLACEMENTS", "Reduced", "StepStats", "TowerTrainer", "check_devices"]


class Reduced(NamedTuple):
    """What ``TowerTrainer.reduce`` hands to ``apply``.

    Attributes:
        grads: ``grads[replica][var]``, the summed gradients each replica applies.
        non_trainable: the combined new value of every non-trainable variable.
        loss: the global mean loss (the towers' shares added in tower order).
        grads_finite: with a ``LossScaleOptimizer``, the step's one "all gradients
            finite" flag (:mod:`towers.guard.loss_scale`); None: each replica checks.
        reducer_state: a stateful reducer's new state, assigned by ``apply`` only when
            the update is (:class:`~towers.allreduce.machinery.base.StatefulReducer`).
    """

    grads: list[list[tf.Tensor | tf.IndexedSlices]]
    non_trainable: list[tf.Tensor]
    loss: tf.Tensor
    grads_finite: tf.Tensor | None = None
    reducer_state: tuple[tf.Tensor, ...] = ()


class TowerTrainer:
    """Data-parallel training over explicit towers with a hand-built all-reduce.

    Args:
        model: a built ``keras.Model`` or a zero-argument factory returning one.
        optimizer: a Keras optimizer or a zero-argument factory.
        loss: a Keras loss, a loss name, or ``(y_true, y_pred) -> per-example losses``.
            A Keras loss's ``reduction`` is honoured over the global batch
            (:data:`towers.training.keras_loss.REDUCTIONS`); ``"none"`` (per-example
            values) trains as the default. A model with several outputs takes one per
            output (a list, a dict by output name, or a
            :class:`~towers.training.losses.OutputLosses` with weights), or one for all.
        devices: the towers' devices (default: every local logical device).
        **options: the trainer's options, each checked and together held in one
            :class:`~towers.guard.options.TowerOptions` (:attr:`options`; its docstring
            describes them): ``all_reduce``, ``variables``, ``parameter_device``,
            ``semantics``, ``sparse``, ``on_nonfinite``, ``step_timeout``,
            ``check_replicas_every``, ``reduce_dtype``, ``check_algorithm``,
            ``loss_denominator``, ``forward_graph``, ``jit_compile``. Which compose is the
            capability table (:mod:`towers.guard.capabilities`): a combination it refuses
            raises a ``ValueError`` naming both options before anything is built.

    Example:
        >>> devices = towers.simulate_devices(4)                      # doctest: +SKIP
        >>> trainer = towers.TowerTrainer(make_model, keras.optimizers.SGD(0.1),
        ...     "sparse_categorical_crossentropy", devices=devices, all_reduce="naive")
        >>> loss = trainer.train_step(x, y)                            # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: OptimizerLike,
        loss: str | LossFn | keras.losses.Loss,
        devices: Sequence[str] | None = None,
        **options: Any,
    ) -> None:
        check_kinds(model, optimizer, loss)
        # Every argument is checked, and their combination against the capability table,
        # before any replica, variable or reducer state is built.
        self.options = o = TowerOptions.of(type(self).__name__, options)
        self.devices = naming("devices", lambda: check_devices(devices))
        self.placement = naming("variables", lambda: get_placement(o.variables))
        all_reduce = capabilities.default_all_reduce(self.placement.name, o.all_reduce)
        self.parameter_device = naming(
            "parameter_device", lambda: check_devices([o.parameter_device or self.devices[0]])[0]
        )
        if is_structured(loss):  # a loss per output (bound to the model's outputs below)
            loss = OutputLosses(loss)
        self.loss_fn = loss if isinstance(loss, OutputLosses) else resolve_loss(loss)
        self.loss_reduction = reduction_of(loss)  # Keras' reduction, over the global batch
        kind_of_optimizer = _optimizer_object(optimizer)
        check_semantics(o.semantics, o.loss_denominator, self.loss_reduction, kind_of_optimizer)
        reducer = naming("all_reduce", lambda: resolve(all_reduce, self.parameter_device))
        kind = capabilities.algorithm_kind(reducer)
        self.sparse = capabilities.default_sparse(self.placement.name, kind, o.sparse)
        trainer = type(self).__name__
        self.cell = o.cell(trainer if trainer in capabilities.AXES["trainer"] else "TowerTrainer",
                           self.placement.name, kind, self.sparse,
                           is_loss_scaled(kind_of_optimizer))  # fmt: skip
        capabilities.check(self.cell, {"all_reduce": capabilities.spell(all_reduce)})
        capabilities.check_limits(self.cell, reducer)
        self.deadline = Deadline(o.step_timeout, reducer)
        self.algorithm: Any = self.deadline.algorithm  # step_timeout bound where it takes one
        self.replica_check = ReplicaCheck(o.check_replicas_every)
        self.reducer = as_reducer(self.algorithm, sparse=self.sparse)
        homes = self.placement.homes(self.devices, self.parameter_device)
        self.replicas: list[Replica] = self.placement.make_replicas(
            model, optimizer, homes, self.algorithm
        )
        if not isinstance(self.loss_fn, OutputLosses) and len(
                getattr(self.model, "output_names", None) or []) > 1:  # fmt: skip
            self.loss_fn = OutputLosses(loss)  # one loss for every output, as Keras's
        if isinstance(self.loss_fn, OutputLosses):
            per_output = self.loss_fn
            naming("loss", lambda: per_output.bind(self.model))
        self.reducer.build(self.model.trainable_variables, self.devices)
        self.loss_scale = LossScale(self.optimizer, self.model, o.reduce_dtype)
        if o.check_algorithm:  # a user's algorithm must sum (the registry's are proved)
            check_sums(reducer, self.devices, self.model.trainable_variables,
                       self.loss_scale.wire_dtype)  # fmt: skip
        self.guard = Guard(
            o.on_nonfinite, len(self.devices), self.parameter_device, self.loss_scale.active,
            agree=self.across_processes,
        )
        # reduce before the guard's cond, checking the reduced gradients (one process)
        self._reduce_first = o.on_nonfinite != "ignore" and sums_exactly(
            reducer, self.placement.name) and type(self).reduce is TowerTrainer.reduce
        self.trace_count = 0
        self.last_trace_stats: Recorder | None = None
        self._forward_stats = Recorder()
        self.trainable_watch = TrainableWatch(self.replicas, self.placement.name)
        self._new_step_functions()

    def _new_step_functions(self) -> None:
        # No reduce_retracing: a static batch size gives static shard sizes (empty towers are
        # skipped at trace time); a new batch size costs one more trace, not one per step.
        self._whole = tf.function(self._train_step, autograph=False)
        self._step: Any = self._whole
        self._step_with_outputs: Any = tf.function(
            functools.partial(self._train_step, with_outputs=True), autograph=False
        )
        self._shard_step: Any = tf.function(self._train_shards, autograph=False)
        self._shard_step_with_outputs: Any = tf.function(
            functools.partial(self._train_shards, with_outputs=True), autograph=False
        )
        self._nested = nests((*self.devices, self.parameter_device))
        if self.options.forward_graph == "default":  # forward_graph: ordering.FORWARD_GRAPHS
            phased = functools.partial(PhasedStep, update=self._update_phase, nested=self._nested)
            self._step = phased(self._forward_phase)
            self._step_with_outputs = phased(
                functools.partial(self._forward_phase, with_outputs=True), with_outputs=True)
            self._shard_step = phased(self._forward_shards)
            self._shard_step_with_outputs = phased(
                functools.partial(self._forward_shards, with_outputs=True), with_outputs=True)
            relaxed = phased(functools.partial(self._forward_phase, with_outputs=True),
                             with_outputs=True)  # fmt: skip
        else:
            relaxed = tf.function(functools.partial(self._train_step, with_outputs=True),
                                  autograph=False)  # fmt: skip
        # TowerModel.fit's step on a dataset whose batch dimension is unknown: functions of
        # its own, traced as Keras traces (towers.training.shapes)
        self._relaxed_step = RelaxedBatch(relaxed)

    def _follow_trainable(self) -> None:
        """A change of ``trainable`` on :attr:`model` since the last step: every replica
        takes it, the reducer is built for the new trainable set, the step is retraced
        (:mod:`towers.guard.trainable`; ``sharded`` refuses)."""
        if self.trainable_watch.changed(self.replicas):
            self.reducer.build(self.model.trainable_variables, self.devices)
            self._new_step_functions()

    @property
    def model(self) -> keras.Model:
        """The trained model (the parameter-device copy, or tower 0's replica)."""
        return self.replicas[0].model

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        """The optimizer of :attr:`model`."""
        return self.replicas[0].optimizer

    def replica_of(self, tower: int) -> Replica:
        """The replica whose weights tower ``tower`` reads."""
        return self.replicas[self.placement.replica_of(tower)]

    # -- the step -----------------------------------------------------------------------------

    def train_step(
        self, x: Any, y: Any, sample_weight: Any = None, *, return_outputs: bool = False
    ) -> Any:
        """Run one synchronous step on a global batch and return the global mean loss.

        With ``return_outputs=True`` it returns ``(loss, outputs)``: the model's outputs
        of this very step (training mode), concatenated in tower order — what training
        metrics should see.

        Raises:
            ValueError: x, y and sample_weight disagree on the batch size, or it is 0.
            NonFiniteError: ``on_nonfinite="raise"`` and a tower met a NaN or Inf (the
                step changed nothing).
            StepTimeout, ReplicaMismatchError: see ``step_timeout``, ``check_replicas_every``.
            ValueError: ``trainable`` changed on :attr:`model` where the trainer cannot
                follow (``variables="sharded"``; a variable frozen when it was built made
                trainable): :mod:`towers.guard.trainable`.
        """
        self._follow_trainable()
        step = self._step_with_outputs if return_outputs else self._step
        return self._run_step(step, self._inputs(x, y, sample_weight))

    def train_step_as_keras(self, x: Any, y: Any, sample_weight: Any, *,
                            batch_unknown: bool) -> Any:  # fmt: skip
        """:meth:`train_step` with ``return_outputs=True`` as ``TowerModel.fit`` calls it:
        with ``batch_unknown`` (Keras's dataset has no fixed batch size) the step is traced
        with the batch dimension unknown, as Keras's own step is
        (:mod:`towers.training.shapes`), unless this batch leaves a tower empty (that
        trace stays static: an empty tower does not run the model).

        Raises:
            TypeError: ``batch_unknown`` is not True or False.
            ValueError, NonFiniteError, StepTimeout, ReplicaMismatchError: as :meth:`train_step`.
        """
        check_bool("batch_unknown", batch_unknown)
        self._follow_trainable()
        inputs = self._inputs(x, y, sample_weight)
        relax = type(self).split is TowerTrainer.split and relaxes(  # a WorkerTrainer: no
            batch_unknown, inputs[0], len(self.devices))  # fmt: skip
        return self._run_step(self._relaxed_step if relax else self._step_with_outputs, inputs)

    def train_step_shards(self, shards: Shards, *, return_outputs: bool = False) -> Any:
        """Run one step on a global batch already split over the towers; return its loss.

        The step of :meth:`train_step` without its split phase: ``shards`` comes from the
        per-device input pipeline (:func:`towers.split.distribute`), each part already on
        its tower's device, or from :meth:`split`. Every tower divides its loss by
        ``shards.global_batch``, so the result is bitwise :meth:`train_step`'s on the
        same global batch. ``return_outputs`` as in :meth:`train_step`.

        Raises:
            TypeError: ``shards`` is not a :class:`~towers.split.Shards`; a subclass that
                cuts its own batches (``WorkerTrainer``: its global batch spans workers).
            ValueError: it has a part per tower other than this trainer's count, sizes
                that are not MirroredStrategy's split of ``global_batch`` examples, no
                example at all, or a part that does not fit the model.
            NonFiniteError, StepTimeout, ReplicaMismatchError: as :meth:`train_step`.
        """
        shards = self._shard_inputs(shards)
        self._follow_trainable()
        step = self._shard_step_with_outputs if return_outputs else self._shard_step
        return self._run_step(step, (shards,))

    def _run_step(self, step: Any, inputs: tuple[Any, ...]) -> Any:
        # forward_graph="default": PhasedStep traces its update as_written() itself
        whole = self.options.forward_graph == "as_written"
        with as_written() if whole else contextlib.nullcontext():
            result = self.deadline.run(step, inputs)
        self.guard.raise_if_nonfinite(self.optimizer, self.devices)
        self.replica_check.after_step(self.replicas, self.deadline.name)
        return result

    def retrace(self) -> None:
        """Trace the step again on its next call: an optimizer's Python hyperparameter
        (``weight_decay``, ``clipnorm``, …) is a constant in the traced graph, so a change
        of one reaches the step only through a new trace (``towers.TowerModel`` calls this)."""
        self._new_step_functions()

    def step_function(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """The step traced for this input signature as one graph (a ``ConcreteFunction``;
        with ``forward_graph="default"`` the step runs the same ops with its reduction and
        update in a nested function, ``ordering.PhasedStep``)."""
        self._follow_trainable()
        return self._whole.get_concrete_function(*self._inputs(x, y, sample_weight))

    def _inputs(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        return batch_tensors(x, y, sample_weight, self.model)

    def _shard_inputs(self, shards: Any) -> Shards:
        """``shards`` checked for :meth:`train_step_shards`; sample weights in the model's dtype."""
        if type(self).split is not TowerTrainer.split:  # WorkerTrainer: B spans the workers
            raise TypeError(f"train_step_shards: {type(self).__name__} cuts its batches itself "
                            f"({type(self).__name__}.split); give it whole batches "
                            "(train_step)")  # fmt: skip
        if not isinstance(shards, Shards):
            raise TypeError("shards must be a towers.split.Shards (from towers.split.distribute "
                            f"or trainer.split), got {type(shards).__name__}")  # fmt: skip
        n = len(self.devices)
        if len(shards.parts) != n or any(len(p) != 3 for p in shards.parts):
            raise ValueError(f"shards must hold {n} parts (x, y, sample_weight), one per tower; "
                             f"got {len(shards.parts)}")  # fmt: skip
        # static where known: inside a caller's tf.function (Keras' train_step) they may not be
        total, sizes = tf.get_static_value(shards.global_batch), shards.sizes
        if total is not None and None not in sizes and (
                total < 1 or sizes != shard_sizes(int(total), n)):  # fmt: skip
            raise ValueError(f"shards: sizes {sizes} are not MirroredStrategy's split of a "
                             f"global batch of {total} over {n} towers "
                             f"({shard_sizes(max(int(total), 0), n)})")  # fmt: skip
        check_batch_against_model(*shards.parts[0], self.model)
        dtype = tf.as_dtype(self.model.trainable_variables[0].dtype)
        parts = []
        for x, y, w in shards.parts:
            if w is not None and w.dtype != dtype:
                with tf.device(w.device):
                    w = tf.cast(w, dtype)
            parts.append((x, y, w))
        return Shards(tuple(parts), shards.global_batch)

    def _train_step(self, x: Any, y: Any, sample_weight: Any, with_outputs: bool = False) -> Any:
        return self._step_body(lambda: self.split(x, y, sample_weight), with_outputs)

    def _train_shards(self, shards: Shards, with_outputs: bool = False) -> Any:
        return self._step_body(lambda: shards, with_outputs)  # split by the input pipeline

    def _step_body(self, make_shards: Any, with_outputs: bool) -> Any:
        self.trace_count += 1
        with record() as recorder:
            with tf.name_scope("split"):  # name scopes: the profiler's phases (bench.phases)
                shards = make_shards()
            grads = self.forward_backward(shards)
            # reduce → apply inside the guard's one tf.cond: all of it or nothing
            with tf.name_scope("guard"):
                loss = self._guarded(grads)
            if with_outputs:
                outputs = concat([r.outputs for r in grads.towers], self.parameter_device)
        self.last_trace_stats = recorder
        return (loss, outputs) if with_outputs else loss

    def _forward_phase(
        self, x: Any, y: Any, sample_weight: Any, with_outputs: bool = False
    ) -> tuple[Gradients, Any]:
        """``forward_graph="default"``'s forward: split, forward_backward (``PhasedStep``)."""
        return self._forward_body(lambda: self.split(x, y, sample_weight), with_outputs)

    def _forward_shards(self, shards: Shards, with_outputs: bool = False) -> tuple[Gradients, Any]:
        return self._forward_body(lambda: shards, with_outputs)  # split by the input pipeline

    def _forward_body(self, make_shards: Any, with_outputs: bool) -> tuple[Gradients, Any]:
        self.trace_count += 1
        with record() as recorder:
            with tf.name_scope("split"):
                shards = make_shards()
            grads = self.forward_backward(shards)
            outputs = None
            if with_outputs:
                outputs = concat([r.outputs for r in grads.towers], self.parameter_device)
        self._forward_stats = recorder
        # the towers' model outputs are not handed over: the update never reads them, and
        # every tensor that crosses into the update costs its call
        return Gradients(tuple(_unchanged_as_none(r)._replace(outputs=None)
                               for r in grads.towers)), outputs  # fmt: skip

    def _update_phase(self, grads: Gradients) -> tf.Tensor:
        """Its update (traced ``as_written()``): the guard's reduce and apply, as in the step."""
        variables = self.model.trainable_variables
        with tf.name_scope("forward_backward"):  # the towers' results, handed over (profiler)
            handed = Gradients(tuple(
                _none_as_unchanged(r, self.replica_of(i))._replace(grads=[
                    _static_dense_shape(g, v) for g, v in zip(r.grads, variables)])
                for i, r in enumerate(grads.towers)
            ))  # fmt: skip
            grads = handed.on_devices(self.devices)  # arguments come without a device
        # Nested (one call, CPUs), the arguments arrive on the call op's device and the
        # guard checks them on its own device: checks pinned to the towers' devices would
        # add one partition per device to the nested function, each an executor run per
        # step (docs/performance.md). Two calls (GPUs): on the towers, as in the step.
        with record() as recorder, tf.name_scope("guard"):
            loss = self._guarded(grads, handed.towers if self._nested else None)
        self.last_trace_stats = Recorder(self._forward_stats.transfers + recorder.transfers)
        return loss

    def _guarded(self, grads: Gradients, central: Sequence[TowerResult] | None = None) -> tf.Tensor:
        """Reduce → apply inside the guard's one ``tf.cond``: all of it or nothing.

        When the reduction :func:`~towers.guard.nonfinite.sums_exactly` (and keeps no
        state), it runs before the cond and the guard's fast path sums one copy of the
        reduced gradients instead of every tower's: a NaN or Inf anywhere is one there.
        ``central``: the towers' results as the nested update received them, checked on
        the guard's device (default: ``grads``' on the towers' devices).
        """
        towers = grads.towers if central is None else central
        run = functools.partial(self.guard.run, towers, self.devices, central=central is not None)
        if not self._reduce_first:
            return run(functools.partial(self._update, grads))  # update(grads_finite)
        with tf.name_scope("reduce"):
            reduced = self.reduce(grads)
        return run(functools.partial(self._update_reduced, reduced),
                   reduced=self.placement.covering(reduced.grads))

    def _update(self, grads: Gradients, grads_finite: tf.Tensor | None = None) -> tf.Tensor:
        with tf.name_scope("reduce"):
            reduced = self.reduce(grads)
        return self._update_reduced(reduced, grads_finite)

    def _update_reduced(self, reduced: Reduced, grads_finite: tf.Tensor | None = None) -> tf.Tensor:
        if self.loss_scale.active:  # one flag for every replica's dynamic scale
            flag = self.loss_scale.finite(reduced.grads[0], grads_finite, self.parameter_device)
            reduced = reduced._replace(grads_finite=flag)
        with tf.name_scope("apply"):
            settled(reduced, self.apply)  # nothing changes before every reduction completed
        return reduced.loss

    def across_processes(self, counts: tf.Tensor) -> tf.Tensor:
        """The guard's counts of bad towers summed over every process that steps together
        (the hook a multi-process trainer overrides; here: this process alone)."""
        return counts

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """Phase 1: cut the global batch into one shard per tower (MirroredStrategy's split).

        Raises:
            ValueError: x, y and sample_weight disagree on the batch size, or it is 0.
        """
        return shard_batch(*self._inputs(x, y, sample_weight), len(self.devices))

    def forward_backward(self, shards: Shards) -> Gradients:
        """Phase 2: every tower's forward and backward pass on its shard, on its device.

        The towers of :meth:`model_towers` run the model; any other (empty) tower does
        not: it contributes zero gradients, its share of the regularization losses
        (loss-scaled as the others), and unchanged state.
        """
        divisor = self.loss_divisor(shards)
        results = {
            i: self.tower_step(shards, i, divisor=divisor) for i in self.model_towers(shards)
        }
        template = results[min(results)]  # dtypes and output structure of the empty towers
        for i in range(len(self.devices)):
            if i not in results:
                replica = self.replica_of(i)
                trainable, frozen = read_weights(replica, self.devices[i])
                results[i] = empty_tower_step(
                    self.model, trainable, frozen, template=template,
                    num_towers=len(self.devices), device=self.devices[i],
                    loss_scale=self.loss_scale.scale(replica.optimizer, replica.device,
                                                     self.devices[i]),
                )  # fmt: skip
        return Gradients(tuple(results[i] for i in range(len(self.devices))))

    def model_towers(self, shards: Shards) -> list[int]:
        """The towers whose shards run the model in :meth:`forward_backward`: those with
        examples (tower 0 always has some: the batch is not empty). The one hook a
        subclass overrides to run the model on an empty shard (``WorkerTrainer``)."""
        return [i for i, size in enumerate(shards.sizes) if size != 0]

    def loss_divisor(self, shards: Shards) -> tf.Tensor:
        """What every tower divides its loss sum by, for the loss's Keras reduction
        (:func:`towers.training.keras_loss.loss_divisor`): the global batch size by default."""
        weights = [part[2] for part in shards.parts]
        return loss_divisor(self.loss_reduction, shards.global_batch, weights,
                            self.parameter_device)  # fmt: skip

    def tower_step(
        self, shards: Shards, tower: int, *, backward: bool = True, divisor: Any = None
    ) -> TowerResult:
        """One tower of :meth:`forward_backward`: read its replica's weights, run its shard.

        ``backward=False`` runs the forward pass alone (for timing it). ``divisor``: the
        step's :meth:`loss_divisor` (formed here when not given).
        """
        if divisor is None:
            divisor = self.loss_divisor(shards)
        divisor = tower_divisor(self.options.semantics, self.options.loss_denominator, divisor,
                                shards.parts[tower], len(self.devices))  # fmt: skip
        device, replica = self.devices[tower], self.replica_of(tower)
        with replica_scope(tower):  # MirroredStrategy's names: Grappler reads them
            trainable, frozen = read_weights(replica, device)
            return tower_step(
                self.model, trainable, frozen, shards.parts[tower], loss_fn=self.loss_fn,
                global_batch=divisor, num_towers=len(self.devices), device=device,
                backward=backward,
                loss_scale=self.loss_scale.scale(replica.optimizer, replica.device, device),
                jit_compile=self.options.jit_compile, loss_reduction=self.loss_reduction,
            )  # fmt: skip

    def reduce(self, grads: Gradients) -> Reduced:
        """Phase 3: all-reduce the gradients, combine the state, add up the loss.

        Gradients go through :attr:`reducer` (``grads[tower][var]`` in, the same out),
        then the placement picks what each replica applies.
        """
        grads = grads.on_devices(self.devices)
        shares = grads.grads
        if self.options.semantics == "mirrored":  # each tower's share clipped, as Keras 3 does
            shares = [self._clipped(i, g) for i, g in enumerate(shares)]
        summed = self.placement.reduce(self.reducer, self.loss_scale.to_wire(shares))
        pending = tuple(self.reducer.take_pending())  # assigned in apply, if applied
        dtypes = [v.dtype for v in self.model.trainable_variables]
        reduced = self.loss_scale.from_wire(summed, dtypes)
        state = combine_non_trainable(
            grads.towers, first_tower=self.options.semantics == "mirrored",
            device=self.parameter_device,
        )  # fmt: skip
        p = self.parameter_device
        with tf.device(p):
            loss = tf.add_n([send(r.loss, p, note="loss") for r in grads.towers])
        return Reduced(reduced, state, loss, reducer_state=pending)

    def _clipped(self, tower: int, grads: list[Any]) -> list[Any]:
        with tf.device(self.devices[tower]):
            return clip_share(self.replica_of(tower).optimizer, grads)

    def _unclipped(self, optimizer: Any) -> Any:
        """``"mirrored"``: the shares were clipped before the all-reduce, not the sum."""
        mirrored = self.options.semantics == "mirrored"
        return unclipped(optimizer) if mirrored else contextlib.nullcontext()

    def apply(self, reduced: Reduced) -> None:
        """Phase 4: each optimizer applies its gradients (every replica's, or every shard
        owner's), the placement finishes (``sharded``: all-gather), the state is assigned,
        and the reducer's new state with it (not on a loss-scale overflow)."""
        for update in self.placement.updates(self.replicas, reduced.grads):
            with tf.device(update.device), self._unclipped(update.optimizer):
                self.loss_scale.apply(
                    update.optimizer, update.grads, reduced.grads_finite,
                    functools.partial(_apply_gradients, variables=update.variables),
                )  # fmt: skip
        self.placement.finish(self.replicas)
        applied = reduced.grads_finite
        if applied is None and self.loss_scale.active:
            # the phases called one by one: the flag the step's _update would have formed
            applied = self.loss_scale.finite(reduced.grads[0], None, self.parameter_device)
        self.reducer.commit(reduced.reducer_state, applied)
        for replica in self.replicas:  # an overflowed step keeps the state too: nothing changes
            with tf.device(replica.device):
                for var, value in zip(replica.model.non_trainable_variables, reduced.non_trainable):
                    value = send(value, replica.device, note="state")
                    var.assign(value if applied is None else tf.where(applied, value, var.value))

    # -- the rest of the public API -----------------------------------------------------------

    @property
    def last_step_stats(self) -> StepStats | None:
        """Communication of one step (bytes per tower and per link, ticks), or None before
        the first step. Counted at :func:`~towers.allreduce.send` when the step was traced;
        traffic of opaque collectives is estimated and flagged. Gradient traffic and the
        step's bookkeeping (loss, state, guard) are also counted apart:
        ``gradient_bytes_per_tower``, ``bookkeeping_bytes_per_tower``."""
        if self.last_trace_stats is None:
            return None
        return StepStats.from_recorder(self.last_trace_stats)

    @property
    def on_nonfinite(self) -> str:
        """What a step with a NaN or Inf does: ``"skip"``, ``"raise"`` or ``"ignore"``."""
        return self.guard.mode

    @property
    def skipped_steps(self) -> int:
        """How many steps the non-finite guard skipped (``on_nonfinite`` "skip"/"raise")."""
        return int(self.guard.skipped.numpy())

    @property
    def last_step_nonfinite(self) -> dict[int, list[str]]:
        """``{tower: ["loss", "gradients", …]}`` of the last step; empty when it was finite
        (or ``on_nonfinite="ignore"``). A non-empty result means the step was skipped."""
        return self.guard.last()

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights as NumPy arrays, in ``model.weights`` order."""
        return variable_values(self.model.weights)

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Set every replica's weights (``model.weights`` order), all or nothing.

        Raises:
            TypeError, ValueError: a wrong count, shape or dtype (naming the index and
                the variable); checked for every array before any is assigned.
        """
        arrays = check_weights(self.model.weights, weights)
        for replica in self.replicas:
            for variable, value in zip(replica.model.weights, arrays):
                variable.assign(value)

    def replica_weights(self) -> list[list[np.ndarray]]:
        """Every replica's weights (one list per replica; a single one for parameter_device)."""
        return [variable_values(r.model.weights) for r in self.replicas]


def _unchanged_as_none(result: TowerResult) -> TowerResult:
    """A tower's result as the first phase returns it: a ``tf.function`` turns the Python
    ``changed`` flags into tensors, so a state value no tower pass assigned is returned as
    None instead (part of the output structure, hence of the second phase's trace)."""
    if result.changed is None:
        return result
    kept = [None if c is False else v for v, c in zip(result.non_trainable, result.changed)]
    return result._replace(non_trainable=kept, changed=None)


def _none_as_unchanged(result: TowerResult, replica: Replica) -> TowerResult:
    """:func:`_unchanged_as_none` undone in the second phase: the variable's value (nothing
    assigned it since the first phase read it) and ``changed`` False."""
    if all(v is not None for v in result.non_trainable):
        return result
    with tf.device(replica.device):
        values = [tf.convert_to_tensor(var.value) if v is None else v
                  for v, var in zip(result.non_trainable, replica.model.non_trainable_variables)]
    changed = tuple(v is not None for v in result.non_trainable)
    return result._replace(non_trainable=values, changed=changed)


def _static_dense_shape(grad: Any, variable: Any) -> Any:
    """An ``IndexedSlices`` argument's ``dense_shape`` is a tensor of unknown value; the
    variable's static shape restores what the one-function step knows (``densify``)."""
    if not isinstance(grad, tf.IndexedSlices) or not variable.shape.is_fully_defined():
        return grad
    dtype = tf.int64 if grad.dense_shape is None else grad.dense_shape.dtype
    shape = tf.constant(variable.shape.as_list(), dtype)
    return tf.IndexedSlices(grad.values, grad.indices, shape)


def _optimizer_object(optimizer: Any) -> Any:
    """An optimizer factory called once to learn the optimizer's kind (the object is
    dropped; the replicas call the factory again)."""
    if callable(optimizer) and not isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer()
    return optimizer


def _apply_gradients(optimizer: Any, grads: list[Any], variables: list[Any]) -> None:
    optimizer.apply_gradients(zip(grads, variables))
