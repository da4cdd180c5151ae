"""``TowerTrainer``: one synchronous data-parallel step, in four public phases.

::

    shards  = trainer.split(x, y, sample_weight)   batch ─▶ shard_0 … shard_{n-1}
    grads   = trainer.forward_backward(shards)     tower i: tf.device(d_i), tape, loss / B_global
    reduced = trainer.reduce(grads)                all-reduce; combine state; sum the loss
    trainer.apply(reduced)                         the optimizer, on every replica

``train_step`` is exactly these four calls: split and forward_backward, then reduce and
apply inside the non-finite guard's one ``tf.cond`` (:meth:`TowerTrainer.reduce_and_apply`:
a step with a NaN or Inf on any tower changes nothing), all within the deadline
(:meth:`TowerTrainer._run`). How they are traced — the towers under the caller's Grappler
settings, reduce and apply as written — is :mod:`towers.compile.step`. A teacher can call
the phases one at a time: each in its own ``tf.function`` under ``as_written()``, they give
bitwise the step's loss, weights and optimizer state. ``train_step_shards(shards)`` is the
step without its split, for a batch the per-device input pipeline already cut and placed
(:func:`towers.split.distribute`).

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
from typing import Any, ClassVar, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.ordering import replica_scope
from towers.allreduce.machinery.primitives import Recorder, StepStats, send
from towers.allreduce.machinery.reducer import as_reducer
from towers.allreduce.machinery.resolve import get
from towers.compile.step import CompiledStep, relaxes
from towers.guard import capabilities
from towers.guard.arguments import check_bool
from towers.guard.deadline import Deadline, settled
from towers.guard.given import check_layers
from towers.guard.inputs import batch_tensors, check_kinds, check_shards, naming
from towers.guard.loss_scale import LossScale, is_loss_scaled
from towers.guard.nonfinite import Guard, sums_exactly
from towers.guard.options import TowerOptions
from towers.guard.reduces import check_sums
from towers.guard.replicas import ReplicaCheck
from towers.guard.semantics import (
    check_semantics,
    clip_share,
    in_mirrored_order,
    tower_divisor,
    unclipped,
)
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
from towers.split import Shards, shard_batch
from towers.tower import (
    Gradients,
    TowerResult,
    combine_non_trainable,
    empty_tower_step,
    tower_step,
)
from towers.training.keras_loss import LossFn, loss_divisor, resolve_loss
from towers.training.losses import OutputLosses, is_structured, reduction_of

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

    batch_is_global: ClassVar[bool] = True
    """The batch handed to :meth:`train_step` is the global batch (``WorkerTrainer``: one
    worker's part; it cannot take shards, nor trace Keras's relaxed batch)."""

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
        check_semantics(o.semantics, o.divisor, self.loss_reduction, kind_of_optimizer)
        reducer = naming(
            "all_reduce", lambda: get(all_reduce, parameter_device=self.parameter_device))
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
        if o.semantics == "mirrored":  # the sum adds in MirroredStrategy's order
            self.reducer.per_tensor = in_mirrored_order(
                reducer, self.algorithm, self.model.name, len(self.devices))
        check_layers(self.model, self.optimizer, len(self.devices), self.placement.name, o.sparse)
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
                       self.loss_scale.wire_dtype, o.step_timeout)  # fmt: skip
        self.guard = Guard(
            o.on_nonfinite, len(self.devices), self.parameter_device, self.loss_scale.active,
            agree=self.across_processes,
        )
        # an exact sum reduces before the guard's cond, which checks one reduced copy
        self._reduce_first = o.on_nonfinite != "ignore" and sums_exactly(
            reducer, self.placement.name)
        self.trace_count = 0
        self.last_trace_stats: Recorder | None = None
        self.trainable_watch = TrainableWatch(self.replicas, self.placement.name)
        self.compiled = CompiledStep(self)

    def _follow_trainable(self) -> None:
        """A change of ``trainable`` on :attr:`model` since the last step: every replica
        takes it, the reducer is built for the new trainable set, the step is retraced
        (:mod:`towers.guard.trainable`; ``sharded`` refuses)."""
        if self.trainable_watch.changed(self.replicas):
            self.reducer.build(self.model.trainable_variables, self.devices)
            self.compiled = CompiledStep(self)

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
        return self._run(self.compiled.steps[return_outputs], self._inputs(x, y, sample_weight))

    def train_step_as_keras(self, x: Any, y: Any, sample_weight: Any, *,
                            batch_unknown: bool) -> Any:  # fmt: skip
        """:meth:`train_step` with ``return_outputs=True`` as ``TowerModel.fit`` calls it:
        with ``batch_unknown`` (Keras's dataset has no fixed batch size) traced with the
        batch dimension unknown, as Keras's own step is (:mod:`towers.compile.step`),
        unless this batch leaves a tower empty (an empty tower does not run the model).

        Raises:
            TypeError: ``batch_unknown`` is not True or False.
            ValueError, NonFiniteError, StepTimeout, ReplicaMismatchError: as :meth:`train_step`.
        """
        check_bool("batch_unknown", batch_unknown)
        self._follow_trainable()
        inputs = self._inputs(x, y, sample_weight)
        relax = self.batch_is_global and relaxes(batch_unknown, inputs[0], len(self.devices))
        return self._run(self.compiled.relaxed if relax else self.compiled.steps[True], inputs)

    def train_step_shards(self, shards: Shards, *, return_outputs: bool = False) -> Any:
        """Run one step on a global batch already split over the towers; return its loss.

        The step of :meth:`train_step` without its split phase: ``shards`` comes from the
        per-device input pipeline (:func:`towers.split.distribute`), each part already on
        its tower's device, or from :meth:`split`. Every tower divides its loss by
        ``shards.global_batch``, so the result is bitwise :meth:`train_step`'s on the
        same global batch. ``return_outputs`` as in :meth:`train_step`.

        Raises:
            TypeError: ``shards`` is not a :class:`~towers.split.Shards`; a trainer whose
                batches are not global (``WorkerTrainer``: its global batch spans workers).
            ValueError: a part per tower other than this trainer's count, sizes that are
                not MirroredStrategy's split of ``global_batch`` examples, no example at
                all, or a part that does not fit the model.
            NonFiniteError, StepTimeout, ReplicaMismatchError: as :meth:`train_step`.
        """
        if not self.batch_is_global:
            name = type(self).__name__
            raise TypeError(f"train_step_shards: {name} cuts its batches itself ({name}.split);"
                            " give it whole batches (train_step)")  # fmt: skip
        shards = check_shards(shards, self.devices, self.model)
        self._follow_trainable()
        return self._run(self.compiled.steps[return_outputs], (shards,))

    def _run(self, step: Any, inputs: tuple[Any, ...]) -> Any:
        """The wrappers around the compiled step, in the order they apply: the deadline
        times its execution (:mod:`towers.guard.deadline`; inside it, the non-finite guard's
        ``tf.cond`` holds reduce and apply: :meth:`reduce_and_apply`), then a skipped step
        raises if asked to, then the replicas are compared every k steps."""
        result = self.deadline.run(step, inputs)
        self.guard.raise_if_nonfinite(self.optimizer, self.devices)
        self.replica_check.after_step(self.replicas, self.deadline.name)
        return result

    def reduce_and_apply(self, grads: Gradients, central: Sequence[TowerResult] | None = None
                         ) -> tf.Tensor:  # fmt: skip
        """Reduce → apply inside the guard's one ``tf.cond``: all of it or nothing.

        A reduction that :func:`~towers.guard.nonfinite.sums_exactly` runs before the cond,
        and the guard checks one copy of the reduced gradients instead of every tower's (a
        NaN or Inf anywhere is one there). ``apply`` waits for every reduced value
        (:func:`~towers.guard.deadline.settled`: a hung reduction changes nothing).
        ``central``: the towers' results as a nested update received them, checked on
        the guard's device (default: ``grads``' on the towers' devices).
        """
        early = None
        if self._reduce_first:
            with tf.name_scope("reduce"):
                early = self.reduce(grads)

        def update(grads_finite: tf.Tensor | None) -> tf.Tensor:
            reduced = early
            if reduced is None:
                with tf.name_scope("reduce"):
                    reduced = self.reduce(grads)
            if self.loss_scale.active:  # one flag for every replica's dynamic scale
                flag = self.loss_scale.finite(reduced.grads[0], grads_finite,
                                              self.parameter_device)  # fmt: skip
                reduced = reduced._replace(grads_finite=flag)
            with tf.name_scope("apply"):
                self.guard.applied(self._state_variables(),
                                   lambda: settled(reduced, self.apply))  # fmt: skip
            return reduced.loss

        covering = None if early is None else self.placement.covering(early.grads)
        return self.guard.run(grads.towers if central is None else central, self.devices,
                              update, reduced=covering, central=central is not None)  # fmt: skip

    def _state_variables(self) -> list[tf.Variable]:
        """Every variable a step's update may change, each once: every replica's model and
        optimizer variables, and the reducer's state."""
        found = [v for r in self.replicas for v in (*r.model.variables, *r.optimizer.variables)]
        dense = self.reducer.dense
        found += list(dense.variables) if isinstance(dense, tf.Module) else []
        return list({id(v): v for v in found}.values())

    def across_processes(self, counts: tf.Tensor) -> tf.Tensor:
        """The guard's counts of bad towers summed over every process that steps together
        (the hook a multi-process trainer overrides; here: this process alone)."""
        return counts

    def retrace(self) -> None:
        """Trace the step again on its next call: an optimizer's Python hyperparameter
        (``weight_decay``, ``clipnorm``, …) is a constant in the traced graph, so a change
        of one reaches the step only through a new trace (``towers.TowerModel`` calls this)."""
        self.compiled = CompiledStep(self)

    def step_function(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """The step traced for this input signature as one graph (a ``ConcreteFunction``;
        with ``forward_graph="default"`` the step runs the same ops with its reduction and
        update in a nested function: :class:`~towers.compile.step.PhasedStep`)."""
        self._follow_trainable()
        return self.compiled.whole[False].get_concrete_function(*self._inputs(x, y, sample_weight))

    def _inputs(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        return batch_tensors(x, y, sample_weight, self.model)

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
        divisor = tower_divisor(self.options.divisor, divisor, shards.parts[tower],
                                len(self.devices))  # fmt: skip
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
            device=self.parameter_device, variables=self.model.non_trainable_variables,
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


def _optimizer_object(optimizer: Any) -> Any:
    """An optimizer factory called once to learn the optimizer's kind (the object is
    dropped; the replicas call the factory again)."""
    if callable(optimizer) and not isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer()
    return optimizer


def _apply_gradients(optimizer: Any, grads: list[Any], variables: list[Any]) -> None:
    optimizer.apply_gradients(zip(grads, variables))
