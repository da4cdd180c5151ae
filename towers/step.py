"""``TowerTrainer``: one synchronous data-parallel step, in four public phases.

::

    shards  = trainer.split(x, y, sample_weight)   batch ─▶ shard_0 … shard_{n-1}
    grads   = trainer.forward_backward(shards)     tower i: tf.device(d_i), tape, loss / B_global
    reduced = trainer.reduce(grads)                all-reduce; combine state; sum the loss
    trainer.apply(reduced)                         the optimizer, on every replica

``train_step`` is exactly these four calls inside one ``tf.function`` (traced once
per input signature), run :func:`towers.allreduce.ordering.as_written` so additions
happen in the order the code states; ``reduce`` and ``apply`` sit inside the
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
project's docs): ``non_trainable="mean"`` (default) averages the towers' updates over
the towers that saw examples, so every copy stays identical; ``"first_tower"`` keeps
tower 0's update, reproducing what MirroredStrategy shows when read. Integer state
(dropout seed counters) advances identically on every tower; tower 0's is kept.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.base import AllReduce, GradientReducer
from towers.allreduce.ordering import as_written
from towers.allreduce.primitives import Recorder, record, send
from towers.allreduce.recording import StepStats
from towers.allreduce.reducer import as_reducer, resolve
from towers.guard.arguments import check_choice
from towers.guard.deadline import Deadline, settled
from towers.guard.inputs import batch_tensors, check_kinds, naming
from towers.guard.loss_scale import LossScale
from towers.guard.nonfinite import NONFINITE, Guard
from towers.guard.replicas import ReplicaCheck
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
from towers.split import Shards, concat, shard_batch
from towers.tower import (
    Gradients,
    LossFn,
    TowerResult,
    combine_non_trainable,
    empty_tower_step,
    resolve_loss,
    tower_step,
)
from towers.training import fit as training_loop

__all__ = ["NON_TRAINABLE", "PLACEMENTS", "Reduced", "StepStats", "TowerTrainer", "check_devices"]

NON_TRAINABLE = ("mean", "first_tower")


class Reduced(NamedTuple):
    """What ``TowerTrainer.reduce`` hands to ``apply``.

    Attributes:
        grads: ``grads[replica][var]``, the summed gradients each replica applies.
        non_trainable: the combined new value of every non-trainable variable.
        loss: the global mean loss (the towers' shares added in tower order).
        grads_finite: with a ``LossScaleOptimizer``, the step's one "all gradients
            finite" flag (:mod:`towers.guard.loss_scale`); None: each replica checks.
    """

    grads: list[list[tf.Tensor | tf.IndexedSlices]]
    non_trainable: list[tf.Tensor]
    loss: tf.Tensor
    grads_finite: tf.Tensor | None = None


class TowerTrainer:
    """Data-parallel training over explicit towers with a hand-built all-reduce.

    Args:
        model: a built ``keras.Model`` or a zero-argument factory returning one.
        optimizer: a Keras optimizer or a zero-argument factory.
        loss: a Keras loss, a loss name, or ``(y_true, y_pred) -> per-example losses``.
        devices: the towers' devices (default: every local logical device).
        all_reduce: a name from ``towers.ALGORITHMS``, an algorithm callable or a
            ``GradientReducer``.
        variables: ``"parameter_device"`` (one copy, updated on the parameter device;
            CentralStorageStrategy's layout), ``"replicated"`` (one copy per tower,
            all updated identically; MirroredStrategy's layout) or ``"sharded"`` (one
            copy per tower, optimizer state and gradients sharded over the towers, ZeRO
            1–2; needs ``all_reduce="ring"``; :mod:`towers.allreduce.sharding`).
        parameter_device: where the single copy lives (default: the first tower).
        non_trainable: ``"mean"`` or ``"first_tower"`` (see the module docstring).
        sparse: ``"gather"`` (keep ``IndexedSlices``, concatenated in tower order, as
            MirroredStrategy does) or ``"densify"`` (dense all-reduce of sparse gradients).
        on_nonfinite: ``"skip"`` (default: a step whose loss, gradients or state hold a
            NaN/Inf on any tower changes nothing and is counted in :attr:`skipped_steps`),
            ``"raise"`` (the same, then :class:`~towers.guard.errors.NonFiniteError`) or
            ``"ignore"`` (apply whatever comes, as tf.distribute does). Skip is the
            default because one bad batch should neither poison every replica nor end a
            long run; see :mod:`towers.guard.nonfinite`.
        step_timeout: seconds a step may run, then ``StepTimeout`` (:mod:`towers.guard.deadline`).
        check_replicas_every: compare the replicas by checksum every k steps
            (:mod:`towers.guard.replicas`). Both default to None: off.
        reduce_dtype: ``"float32"`` (default) or ``"compute"`` (the model's dtype
            policy's compute dtype) for the gradient all-reduce. Mixed precision is the
            model's own policy (build it under ``keras.mixed_precision``) and, for
            float16, a ``keras.optimizers.LossScaleOptimizer``: see
            :mod:`towers.guard.loss_scale` and docs/mixed_precision.md.

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
        all_reduce: str | AllReduce | GradientReducer = "parameter_device",
        variables: str = "parameter_device",
        parameter_device: str | None = None,
        non_trainable: str = "mean",
        sparse: str = "gather",
        on_nonfinite: str = "skip",
        step_timeout: float | None = None,
        check_replicas_every: int | None = None,
        reduce_dtype: str = "float32",
    ) -> None:
        check_kinds(model, optimizer, loss)
        check_choice("on_nonfinite", on_nonfinite, NONFINITE)  # before any replica is built
        self.devices = naming("devices", lambda: check_devices(devices))
        self.placement = naming("variables", lambda: get_placement(variables))
        self.non_trainable_mode = check_choice("non_trainable", non_trainable, NON_TRAINABLE)
        self.sparse = check_choice("sparse", sparse, ("gather", "densify"))
        self.parameter_device = naming(
            "parameter_device", lambda: check_devices([parameter_device or self.devices[0]])[0]
        )
        self.loss_fn = resolve_loss(loss)
        reducer = naming("all_reduce", lambda: resolve(all_reduce, self.parameter_device))
        self.deadline = Deadline(step_timeout, reducer)
        self.algorithm: Any = self.deadline.algorithm  # step_timeout bound where it takes one
        self.replica_check = ReplicaCheck(check_replicas_every)
        self.reducer = as_reducer(self.algorithm, sparse=self.sparse)
        homes = self.placement.homes(self.devices, self.parameter_device)
        self.replicas: list[Replica] = self.placement.make_replicas(
            model, optimizer, homes, self.algorithm
        )
        self.reducer.build(self.model.trainable_variables, self.devices)
        self.loss_scale = LossScale(self.optimizer, self.model, reduce_dtype)
        self.guard = Guard(
            on_nonfinite, len(self.devices), self.parameter_device, self.loss_scale.active
        )
        self.trace_count = 0
        self.last_trace_stats: Recorder | None = None
        # No reduce_retracing: a static batch size gives static shard sizes (empty towers are
        # skipped at trace time); a new batch size costs one more trace, not one per step.
        self._step = tf.function(self._train_step, autograph=False)
        self._step_with_outputs = tf.function(
            functools.partial(self._train_step, with_outputs=True), autograph=False
        )

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
        """
        step = self._step_with_outputs if return_outputs else self._step
        with as_written():
            result = self.deadline.run(step, self._inputs(x, y, sample_weight))
        self.guard.raise_if_nonfinite(self.optimizer, self.devices)
        self.replica_check.after_step(self.replicas, self.deadline.name)
        return result

    def step_function(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """The step traced for this input signature (a ``ConcreteFunction``: its graph)."""
        return self._step.get_concrete_function(*self._inputs(x, y, sample_weight))

    def _inputs(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        return batch_tensors(x, y, sample_weight, self.model)

    def _train_step(self, x: Any, y: Any, sample_weight: Any, with_outputs: bool = False) -> Any:
        self.trace_count += 1
        with record() as recorder:
            with tf.name_scope("split"):  # name scopes: the profiler's phases (bench.phases)
                shards = self.split(x, y, sample_weight)
            grads = self.forward_backward(shards)
            # reduce → apply inside the guard's one tf.cond: all of it or nothing
            with tf.name_scope("guard"):
                update = functools.partial(self._update, grads)  # update(grads_finite)
                loss = self.guard.run(grads.towers, self.devices, update)
            if with_outputs:
                outputs = concat([r.outputs for r in grads.towers], self.parameter_device)
        self.last_trace_stats = recorder
        return (loss, outputs) if with_outputs else loss

    def _update(self, grads: Gradients, grads_finite: tf.Tensor | None = None) -> tf.Tensor:
        with tf.name_scope("reduce"):
            reduced = self.reduce(grads)
        if self.loss_scale.active:  # one flag for every replica's dynamic scale
            flag = self.loss_scale.finite(reduced.grads[0], grads_finite, self.parameter_device)
            reduced = reduced._replace(grads_finite=flag)
        with tf.name_scope("apply"):
            settled(reduced, self.apply)  # nothing changes before every reduction completed
        return reduced.loss

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """Phase 1: cut the global batch into one shard per tower (MirroredStrategy's split).

        Raises:
            ValueError: x, y and sample_weight disagree on the batch size, or it is 0.
        """
        return shard_batch(*self._inputs(x, y, sample_weight), len(self.devices))

    def forward_backward(self, shards: Shards) -> Gradients:
        """Phase 2: every tower's forward and backward pass on its shard, on its device.

        An empty tower does not run the model; it contributes zero gradients, its
        share of the regularization losses, and unchanged state.
        """
        results = {
            i: self.tower_step(shards, i) for i, size in enumerate(shards.sizes) if size != 0
        }
        template = results[0]  # tower 0 always has examples: the batch is not empty
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

    def tower_step(self, shards: Shards, tower: int, *, backward: bool = True) -> TowerResult:
        """One tower of :meth:`forward_backward`: read its replica's weights, run its shard.

        ``backward=False`` runs the forward pass alone (for timing it).
        """
        device, replica = self.devices[tower], self.replica_of(tower)
        with tf.name_scope(f"tower_{tower}"):
            trainable, frozen = read_weights(replica, device)
            return tower_step(
                self.model, trainable, frozen, shards.parts[tower], loss_fn=self.loss_fn,
                global_batch=shards.global_batch, num_towers=len(self.devices), device=device,
                backward=backward,
                loss_scale=self.loss_scale.scale(replica.optimizer, replica.device, device),
            )  # fmt: skip

    def reduce(self, grads: Gradients) -> Reduced:
        """Phase 3: all-reduce the gradients, combine the state, add up the loss.

        Gradients go through :attr:`reducer` (``grads[tower][var]`` in, the same out),
        then the placement picks what each replica applies.
        """
        grads = grads.on_devices(self.devices)
        summed = self.placement.reduce(self.reducer, self.loss_scale.to_wire(grads.grads))
        dtypes = [v.dtype for v in self.model.trainable_variables]
        reduced = self.loss_scale.from_wire(summed, dtypes)
        state = combine_non_trainable(
            grads.towers, first_tower=self.non_trainable_mode == "first_tower",
            device=self.parameter_device,
        )  # fmt: skip
        p = self.parameter_device
        with tf.device(p):
            loss = tf.add_n([send(r.loss, p, note="loss") for r in grads.towers])
        return Reduced(reduced, state, loss)

    def apply(self, reduced: Reduced) -> None:
        """Phase 4: each optimizer applies its gradients (every replica's, or every shard
        owner's), the placement finishes (``sharded``: all-gather), the state is assigned."""
        for update in self.placement.updates(self.replicas, reduced.grads):
            with tf.device(update.device):
                self.loss_scale.apply(
                    update.optimizer, update.grads, reduced.grads_finite,
                    functools.partial(_apply_gradients, variables=update.variables),
                )  # fmt: skip
        self.placement.finish(self.replicas)
        for replica in self.replicas:
            with tf.device(replica.device):
                for var, value in zip(replica.model.non_trainable_variables, reduced.non_trainable):
                    var.assign(send(value, replica.device, note="state"))

    # -- the rest of the public API -----------------------------------------------------------

    @property
    def last_step_stats(self) -> StepStats | None:
        """Communication of one step (bytes per tower and per link, ticks), or None before
        the first step. Counted at :func:`~towers.allreduce.send` when the step was traced;
        traffic of opaque collectives is estimated and flagged."""
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

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """Keras-style training loop; see :func:`towers.training.fit.fit`."""
        return training_loop.fit(self, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Loss and metrics over a dataset, split over towers; see ``training.fit.evaluate``."""
        return training_loop.evaluate(self, *args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Model outputs, split over towers; see :func:`towers.training.fit.predict`."""
        return training_loop.predict(self, *args, **kwargs)

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


def _apply_gradients(optimizer: Any, grads: list[Any], variables: list[Any]) -> None:
    optimizer.apply_gradients(zip(grads, variables))
