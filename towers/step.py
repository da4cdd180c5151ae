"""``TowerTrainer``: one synchronous data-parallel step, in four public phases.

::

    train_step(x, y, w)
      shards  = split(x, y, w)           batch ─▶ shard_0 … shard_{n-1}   towers/split.py
      grads   = forward_backward(shards) tower i: tf.device(d_i), tape   towers/tower.py
      ┌ non-finite guard: one tf.cond (reduce_and_apply) ──────────┐
      │ reduced = reduce(grads)    all-reduce; combine state; loss  │
      │ apply(reduced)             the optimizer on every replica   │
      └─────────────────────────────────────────────────────────────┘

    the wrappers fit's step passes, outermost first (_run composes them):
      relaxed batch    traced with Keras's batch unknown  compile/relaxed.py
      deadline         where a peer could be waited on   guard/deadline.py
      PhasedStep       towers as the caller's, update as_written*  compile/step.py
      guard's tf.cond  reduce → apply, or nothing        guard/nonfinite.py
    (* semantics="mirrored": the update under the caller's settings too)

Each phase called alone inside ``as_written()`` gives bitwise the step's result.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import tensorflow as tf

from towers.allreduce.machinery.base import replica_scope
from towers.allreduce.machinery.primitives import StepStats, send
from towers.guard.inputs import check_shards
from towers.guard.options import TrainerParts
from towers.guard.semantics import clip_share, strategy_rewrites, unclipped
from towers.placement import PLACEMENTS, check_devices, combine_non_trainable
from towers.split import Shards, batch_tensors, relaxes, shard_batch
from towers.tower import Gradients, TowerResult, empty_tower_step, loss_divisor
from towers.tower import tower_step as run_tower
from towers.training.synchronized import check_not_alone, synchronized_towers

__all__ = ["PLACEMENTS", "Reduced", "StepStats", "TowerTrainer", "check_devices"]


class Reduced(NamedTuple):
    """What ``reduce`` hands to ``apply``: ``grads[replica][var]``, the combined state, the
    loss; a loss scale's ``grads_finite`` flag; a stateful reducer's new state."""

    grads: list[list[tf.Tensor | tf.IndexedSlices]]
    non_trainable: list[tf.Tensor]
    loss: tf.Tensor
    grads_finite: tf.Tensor | None = None
    reducer_state: tuple[tf.Tensor, ...] = ()


class TowerTrainer(TrainerParts):
    """Data-parallel training over explicit towers with a hand-built all-reduce.

    Args:
        model: a built ``keras.Model`` or a zero-argument factory returning one.
        optimizer: a Keras optimizer or a zero-argument factory.
        loss: a Keras loss, a loss name, or ``(y_true, y_pred) -> per-example losses``;
            its ``reduction`` is honoured over the global batch. A model with several
            outputs takes one per output (a list, a dict, an ``OutputLosses``) or one for all.
        devices: the towers' devices (default: every local logical device).
        **options: :class:`~towers.guard.options.TowerOptions` (:attr:`options`), checked
            with their combination against the capability table before anything is built.

    Attributes:
        model: the trained model (the parameter-device copy, or tower 0's replica).
        optimizer: its optimizer.
    """

    batch_is_global: ClassVar[bool] = True
    """``train_step`` takes the global batch (``WorkerTrainer``: one worker's part)."""

    def train_step(self, x: Any, y: Any, sample_weight: Any = None, *,
                   return_outputs: bool = False) -> Any:  # fmt: skip
        """One synchronous step on a global batch; the global mean loss (with
        ``return_outputs``: ``(loss, outputs)``, this step's outputs in tower order).

        Raises:
            ValueError: a batch that does not fit the model or is empty; ``trainable``
                changed where the trainer cannot follow (:mod:`towers.placement`).
            NonFiniteError, StepTimeout, ReplicaMismatchError: ``on_nonfinite="raise"``,
                ``step_timeout``, ``check_replicas_every``.
        """
        return self._run(return_outputs, self._inputs(x, y, sample_weight))

    def train_step_as_keras(self, x: Any, y: Any, sample_weight: Any, *,
                            batch_unknown: bool) -> Any:  # fmt: skip
        """``train_step(..., return_outputs=True)`` as ``TowerModel.fit`` calls it: traced
        with the batch dimension unknown when Keras's is (unless a tower would be empty)."""
        if batch_unknown is not True and batch_unknown is not False:
            raise TypeError(f"batch_unknown must be True or False, got {batch_unknown!r}")
        inputs = self._inputs(x, y, sample_weight)
        relax = self.batch_is_global and relaxes(batch_unknown, inputs[0], len(self.devices))
        return self._run("relaxed" if relax else True, inputs)

    def train_step_shards(self, shards: Shards, *, return_outputs: bool = False) -> Any:
        """The step on ``shards`` already cut and placed: bitwise :meth:`train_step`'s.

        Raises:
            TypeError: not :class:`~towers.split.Shards`; batches not global (``WorkerTrainer``).
            ValueError: shards that are not MirroredStrategy's split for this trainer.
        """
        if not self.batch_is_global:
            name = type(self).__name__
            raise TypeError(f"train_step_shards: {name} cuts its batches itself ({name}.split);"
                            " give it whole batches (train_step)")  # fmt: skip
        return self._run(return_outputs, (check_shards(shards, self.devices, self.model),))

    def _run(self, outputs: bool | str, inputs: tuple[Any, ...]) -> Any:
        """The compiled step (``outputs``: True, False or ``"relaxed"``), under the deadline
        where something can wait on a peer; then the guard's and replica checks."""
        self.follower.follow(self)  # replica 0's flags and hyperparameters reach all
        step = self.compiled.relaxed if isinstance(outputs, str) else self.compiled.steps[outputs]
        result = self.deadline.run(step, inputs) if self.timed else step(*inputs)
        if self.guard.mode == "raise":
            self.guard.raise_if_nonfinite(self.optimizer, self.devices)
        if self.replica_check.every:
            self.replica_check.after_step(self.replicas, self.deadline.name)
        return result

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """Phase 1: one shard per tower (MirroredStrategy's split of the global batch)."""
        return shard_batch(*self._inputs(x, y, sample_weight), len(self.devices))

    def forward_backward(self, shards: Shards) -> Gradients:
        """Phase 2: every tower's forward and backward pass on its shard, on its device
        (an empty tower: zero gradients, its share of the regularization losses)."""
        weights = [part[2] for part in shards.parts]  # the loss's divisor, for every tower
        divisor = loss_divisor(self.loss_reduction, shards.global_batch, weights,
                               self.parameter_device)  # fmt: skip
        if self.synchronized:  # BatchNormalization(synchronized=True): the towers meet
            ran = synchronized_towers(self, shards, divisor)
        else:
            ran = {i: self.tower_step(shards, i, divisor=divisor)
                   for i in self.model_towers(shards)}  # fmt: skip
        results = []
        for i, device in enumerate(self.devices):
            if i in ran:
                results.append(ran[i])
                continue
            replica = self.replicas.replica_of(i)
            trainable, frozen = self.replicas.read(i, device)
            results.append(empty_tower_step(
                self.model, trainable, frozen, template=ran[min(ran)],
                num_towers=len(self.devices), device=device,
                loss_scale=self.loss_scale.scale(replica.optimizer, replica.device, device)))
        return Gradients(tuple(results))

    def model_towers(self, shards: Shards) -> list[int]:
        """The towers that run the model: those with examples (``WorkerTrainer``: all)."""
        return [i for i, size in enumerate(shards.sizes) if size != 0]

    def tower_step(self, shards: Shards, tower: int, *, backward: bool = True,
                   divisor: Any = None) -> TowerResult:  # fmt: skip
        """One tower of :meth:`forward_backward` (``backward=False``: the forward alone)."""
        if self.synchronized:
            check_not_alone(self.synchronized)
        if divisor is None:  # forward_backward's, for one tower alone
            divisor = loss_divisor(self.loss_reduction, shards.global_batch,
                                   [part[2] for part in shards.parts], self.parameter_device)
        part, n = shards.parts[tower], len(self.devices)
        device, scale = self.devices[tower], self.loss_scale
        replica = self.replicas.replica_of(tower)
        with replica_scope(tower):  # MirroredStrategy's names: Grappler reads them
            trainable, frozen = self.replicas.read(tower, device)
            return run_tower(
                self.model, trainable, frozen, part, loss_fn=self.loss_fn, global_batch=divisor,
                num_towers=n, device=device, backward=backward,
                loss_scale=scale.scale(replica.optimizer, replica.device, device)
                if scale.active else None,
                jit_compile=self.options.jit_compile, loss_reduction=self.loss_reduction,
                divisor_rule=self.divisor_rule)

    def reduce_and_apply(self, grads: Gradients,
                         central: Sequence[TowerResult] | None = None) -> tf.Tensor:  # fmt: skip
        """Reduce → apply in the guard's ``tf.cond``: all or nothing. A reduction that
        :func:`~towers.guard.capabilities.sums_exactly` runs first (the guard checks one
        reduced copy). ``central``: the towers' results as a nested update received them."""
        early = None
        if self._reduce_first:
            with tf.name_scope("reduce"):
                early = self.reduce(grads)
        covering = None if early is None else self.placement.covering(early.grads)
        update = functools.partial(self._update, grads, early)
        return self.guard.run(grads.towers if central is None else central, self.devices,
                              update, reduced=covering, central=central is not None)  # fmt: skip

    def _update(self, grads: Gradients, reduced: Reduced | None,
                grads_finite: tf.Tensor | None) -> tf.Tensor:  # fmt: skip
        """The guard's true branch: reduce (unless done before), then apply once settled."""
        if reduced is None:
            with tf.name_scope("reduce"):
                reduced = self.reduce(grads)
        if self.loss_scale.active:  # one flag for every replica's dynamic scale
            flag = self.loss_scale.finite(reduced.grads[0], grads_finite, self.parameter_device)
            reduced = reduced._replace(grads_finite=flag)
        # Apply once all of ``reduced`` exists, after marking that the apply began: a
        # collective that never completes leaves every variable, slot and counter as it was
        # (guard/deadline.py). Control edges only: the bits are unchanged.
        flat = [t for t in tf.nest.flatten(reduced, expand_composites=True) if t is not None]
        with tf.control_dependencies(flat):
            marks = [self.deadline.began.assign(True)] if self.timed else []
        with tf.name_scope("apply"), tf.control_dependencies(flat + marks):
            self.guard.applied(self.replicas.state_variables(self.reducer),
                               functools.partial(self.apply, reduced))  # fmt: skip
        return reduced.loss

    def reduce(self, grads: Gradients) -> Reduced:
        """Phase 3: all-reduce the gradients (the placement picks each replica's share),
        combine the state, add up the loss."""
        grads = grads.on_devices(self.devices)
        mirrored = self.options.semantics == "mirrored"
        shares = grads.grads
        for i, device in enumerate(self.devices if mirrored else ()):  # clipped, as Keras 3
            with tf.device(device):
                shares[i] = clip_share(self.replicas.replica_of(i).optimizer, shares[i])
        casts = self.loss_scale.casts  # else the wire carries the variables' dtypes
        summed = self.placement.reduce(self.reducer, self.loss_scale.to_wire(shares) if casts
                                       else shares)  # fmt: skip
        pending = tuple(self.reducer.pending)  # assigned in apply, if applied
        dtypes = [v.dtype for v in self.model.trainable_variables]
        reduced = self.loss_scale.from_wire(summed, dtypes) if casts else summed
        state = combine_non_trainable(grads.towers, first_tower=mirrored,
                                      device=self.parameter_device,
                                      variables=self.model.non_trainable_variables)  # fmt: skip
        p = self.parameter_device
        with tf.device(p):
            loss = tf.add_n([send(r.loss, p, note="loss") for r in grads.towers])
        return Reduced(reduced, state, loss, reducer_state=pending)

    def apply(self, reduced: Reduced) -> None:
        """Phase 4: each optimizer applies its gradients (every replica's, or every shard
        owner's), the placement finishes (``sharded``: all-gather), the state is assigned,
        and the reducer's new state with it (not on a loss-scale overflow)."""
        mirrored = self.options.semantics == "mirrored"  # clipped the shares, not the sum
        for update in self.placement.updates(self.replicas, reduced.grads):
            keep = unclipped(update.optimizer) if mirrored else contextlib.nullcontext()
            with tf.device(update.device), keep:
                apply: Any = functools.partial(_apply_gradients, variables=update.variables)
                if mirrored and self.options.forward_graph == "default":
                    apply = strategy_rewrites(apply)  # the strategy's Grappler rewrites
                if self.loss_scale.active:  # the dynamic scale's rule around the apply
                    self.loss_scale.apply(update.optimizer, update.grads, reduced.grads_finite,
                                          apply)  # fmt: skip
                else:
                    apply(update.optimizer, update.grads)
        self.placement.finish(self.replicas)
        applied = reduced.grads_finite
        if applied is None and self.loss_scale.active:  # the phases called one by one
            applied = self.loss_scale.finite(reduced.grads[0], None, self.parameter_device)
        self.reducer.commit(reduced.reducer_state, applied)
        for replica in self.replicas:  # an overflowed step keeps the state too
            with tf.device(replica.device):
                for var, value in zip(replica.model.non_trainable_variables, reduced.non_trainable):
                    value = send(value, replica.device, note="state")
                    var.assign(value if applied is None else tf.where(applied, value, var.value))

    def _inputs(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        """The batch checked against the model and made tensors (a worker's part may be
        empty: with fewer examples than workers, it still joins every collective)."""
        return batch_tensors(x, y, sample_weight, self.model, allow_empty=not self.batch_is_global)

    def step_function(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """The step traced for this input signature as one ``ConcreteFunction``."""
        self.follower.follow(self)  # replica 0's flags and hyperparameters reach all
        return self.compiled.whole[False].get_concrete_function(
            *self._inputs(x, y, sample_weight))


def _apply_gradients(optimizer: Any, grads: list[Any], variables: list[Any]) -> None:
    optimizer.apply_gradients(zip(grads, variables))
