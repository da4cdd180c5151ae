"""Where the variables live, and a trainer's replicas: each one the whole model.

A *replica* is one (model, optimizer) pair whose variables sit on one device::

    placement          homes                 tower i reads    replica k applies
    parameter_device   [parameter device]    replica 0        reduced[0] (all are equal)
    replicated         [tower 0 … n-1]       replica i        reduced[k]
    sharded            [tower 0 … n-1]       replica i        its chunk of every gradient
                                                              to its shard, then all-gather

:class:`Replicas` makes, synchronizes (:meth:`~Replicas.broadcast`) and reads
(:meth:`~Replicas.read`) them: every tower runs replica 0's network on its replica's values.
The replicas stay one model: the towers' new state is combined by its Keras aggregation
(:func:`combine_non_trainable`), and replica 0's hyperparameters and trainable flags are
followed by every replica (:class:`Follower`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.collectives import broadcast
from towers.allreduce.machinery import sharding
from towers.allreduce.machinery.primitives import send
from towers.allreduce.machinery.registry import Record, Registry
from towers.allreduce.machinery.sparse import densified
from towers.allreduce.parameter_device import reduce_on
from towers.guard.given import check_devices, check_weights
from towers.training.keras_copies import ModelLike, OptimizerLike, new_model, new_optimizer

__all__ = ["AGGREGATIONS", "PLACEMENTS", "Follower", "ModelLike", "OptimizerLike",
           "ParameterDevice", "Placement", "Replica", "Replicas", "Replicated", "Sharded",
           "Update", "check_devices", "combine_non_trainable", "get_placement",
           "optimizer_state_bytes", "place"]

@dataclasses.dataclass
class Replica:
    """A model and its optimizer on ``device`` (``sharded``: slots for its shard only)."""

    device: str
    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    sharded: bool = False


class Update(NamedTuple):
    """One ``optimizer.apply_gradients(zip(grads, variables))`` the step runs on ``device``."""

    device: str
    optimizer: keras.optimizers.Optimizer
    grads: list[Any]
    variables: list[Any]


class Placement:
    """Where a trainer's variable copies live and how towers and updates reach them."""

    name: ClassVar[str]

    def make_replicas(self, model: ModelLike, optimizer: OptimizerLike,
                      homes: list[str]) -> list[Replica]:  # fmt: skip
        """The trainer's replicas, one per home."""
        return _make_replicas(model, optimizer, homes)

    def reduce(self, reducer: Any, grads: list[list[Any]]) -> list[list[Any]]:
        """``grads[tower][var]`` -> what each replica applies (default: the all-reduce's)."""
        return list(reducer.reduce_gradients(grads))

    def updates(self, replicas: Sequence[Replica], reduced: list[list[Any]]) -> list[Update]:
        """The optimizer updates of one step (default: every replica applies its gradients)."""
        return [Update(r.device, r.optimizer, list(g), list(r.model.trainable_variables))
                for r, g in zip(replicas, reduced)]  # fmt: skip

    def finish(self, replicas: Sequence[Replica]) -> None:
        """After the updates (default: nothing; ``sharded`` all-gathers the parameters)."""

    def covering(self, reduced: list[list[Any]]) -> list[Any]:
        """One copy of every reduced gradient element (default: the first replica's)."""
        return list(reduced[0])

    def homes(self, devices: Sequence[str], parameter_device: str) -> list[str]:
        """The device of each replica (default: one per tower)."""
        return list(devices)


class ParameterDevice(Placement):
    """One copy on the parameter device (CentralStorageStrategy's layout)."""

    name = "parameter_device"

    def homes(self, devices: Sequence[str], parameter_device: str) -> list[str]:
        return [parameter_device]

    def reduce(self, reducer: Any, grads: list[list[Any]]) -> list[list[Any]]:
        # Every output holds the same sum; the unused copies are pruned from the graph.
        return list(reducer.reduce_gradients(grads))[:1]


class Replicated(Placement):
    """One copy per tower, all updated identically (MirroredStrategy's layout)."""

    name = "replicated"


class Sharded(Replicated):
    """One weight copy per tower; tower k owns chunk k of every gradient and optimizer slot:
    ring reduce-scatter, each owner updates its shard, all-gather (ZeRO 1–2;
    :mod:`towers.allreduce.machinery.sharding`). One instance per trainer (its plan)."""

    name = "sharded"

    def __init__(self) -> None:
        self.plan = sharding.ShardPlan([])

    def make_replicas(self, model: ModelLike, optimizer: OptimizerLike,
                      homes: list[str]) -> list[Replica]:  # fmt: skip
        """Replicas whose optimizers hold slots only for their own shards.

        Raises:
            ValueError: the optimizer is not elementwise.
        """
        self.plan = sharding.ShardPlan(homes)
        replicas = _make_replicas(model, optimizer, homes, build_on=self.plan.shards_for)
        sharding.check_optimizer(replicas[0].optimizer)
        return [dataclasses.replace(r, sharded=True) for r in replicas]

    def reduce(self, reducer: Any, grads: list[list[Any]]) -> list[list[Any]]:
        """``grads[tower][var]`` -> ``owned[owner][var]`` (None where a shard is empty)."""
        return self.plan.reduce_scatter(densified(grads))

    def updates(self, replicas: Sequence[Replica], reduced: list[list[Any]]) -> list[Update]:
        """Refresh each owner's shard from its replica; one update per owner with a shard."""
        self.plan.load(replicas)
        return [Update(replicas[k].device, replicas[k].optimizer, grads, shards)
                for k, (grads, shards) in enumerate(self.plan.pairs(reduced)) if shards]

    def covering(self, reduced: list[list[Any]]) -> list[Any]:
        return [g for owned in reduced for g in owned if g is not None]

    def finish(self, replicas: Sequence[Replica]) -> None:
        """All-gather the updated shards into every replica."""
        self.plan.all_gather(replicas)


PLACEMENTS = Registry(["placement"], [
    Record("parameter_device", ParameterDevice, kind="placement",
           summary="one copy on the parameter device (CentralStorageStrategy's layout)"),
    Record("replicated", Replicated, kind="placement",
           summary="one copy per tower, all updated alike (MirroredStrategy's layout)"),
    Record("sharded", Sharded, kind="placement",
           summary="one copy per tower; tower k owns chunk k of every gradient and slot"),
])
"""The placements ``TowerTrainer(variables=...)`` accepts; ``PLACEMENTS[name]()`` makes one."""


def get_placement(name: str | Placement) -> Placement:
    """The placement called ``name`` (a :class:`Placement` passes through; a ``ValueError``
    for an unknown name)."""
    if isinstance(name, Placement):
        return name
    if name not in PLACEMENTS:
        raise ValueError(f"variables must be one of {', '.join(PLACEMENTS)}; got {name!r}")
    placement: Placement = PLACEMENTS[name]()
    return placement


class Replicas(list[Replica]):
    """A trainer's replicas (a list, replica 0 first) and the placement that made them."""

    def __init__(self, replicas: list[Replica], placement: Placement) -> None:
        super().__init__(replicas)
        self.placement = placement

    def replica_of(self, tower: int) -> Replica:
        """The replica whose weights tower ``tower`` reads: the only one, or its own."""
        return self[0] if len(self) == 1 else self[tower]

    def read(self, tower: int, device: str) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """Tower ``tower``'s trainable and non-trainable values, on ``device``."""
        replica = self.replica_of(tower)
        with tf.device(replica.device):
            trainable = [tf.convert_to_tensor(v.value) for v in replica.model.trainable_variables]
            frozen = [tf.convert_to_tensor(v.value) for v in replica.model.non_trainable_variables]
        src = replica.device
        return ([send(t, device, src=src, note="read-weights") for t in trainable],
                [send(t, device, src=src, note="read-weights") for t in frozen])  # fmt: skip

    def get_weights(self) -> list[np.ndarray]:
        """Replica 0's weights as NumPy arrays, in ``model.weights`` order."""
        return _values(self[0].model.weights)

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Set every replica's weights (``model.weights`` order), all or nothing (a
        ``TypeError``/``ValueError`` naming the index of a wrong count, shape or dtype)."""
        arrays = check_weights(self[0].model.weights, weights)
        for replica in self:
            for variable, value in zip(replica.model.weights, arrays):
                variable.assign(value)

    def weights(self) -> list[list[np.ndarray]]:
        """Every replica's weights (one list per replica)."""
        return [_values(r.model.weights) for r in self]

    def state_variables(self, reducer: Any) -> list[tuple[tf.Variable, ...]]:
        """Every variable an update may change, each once (replicas' and reducer's), with
        the copies that hold its value before and after the update: a trainable variable
        on every replica (updated alike, or all-gathered under ``sharded``), and under
        ``replicated`` an optimizer variable on every replica too."""
        mirrored = [r.model.trainable_variables for r in self]
        if self.placement.name == "replicated":
            mirrored = [[*m, *r.optimizer.variables] for m, r in zip(mirrored, self)]
        rows = list(zip(*mirrored, strict=True)) if len(self) > 1 else []
        copies = {id(v) for row in rows for v in row}
        found = [v for r in self for v in (*r.model.variables, *r.optimizer.variables)]
        dense = reducer.dense
        found += list(dense.variables) if isinstance(dense, tf.Module) else []
        rows += [(v,) for v in {id(v): v for v in found if id(v) not in copies}.values()]
        return rows

    def broadcast(self) -> None:
        """Copy replica 0's weights, and (``replicated``) its optimizer variables, to every
        other replica: one :func:`~towers.allreduce.broadcast` per dtype, of one flat buffer."""
        if len(self) < 2:
            return
        devices = [r.device for r in self]
        copied = [list(r.model.weights) for r in self]
        if self.placement.name == "replicated":
            copied = [w + list(r.optimizer.variables) for w, r in zip(copied, self)]
        rows = list(zip(*copied))  # rows[j]: variable j on every replica
        for dtype in dict.fromkeys(row[0].dtype for row in rows):
            group = [row for row in rows if row[0].dtype == dtype]
            with tf.device(devices[0]):
                flat = tf.concat([tf.reshape(row[0].value, [-1]) for row in group], axis=0)
            copies = broadcast(flat, devices, algorithm="flat")
            sizes = [int(row[0].shape.num_elements()) for row in group]
            for i in range(1, len(self)):
                with tf.device(devices[i]):
                    for row, piece in zip(group, tf.split(copies[i], sizes)):
                        row[i].assign(tf.reshape(piece, row[i].shape))


def _make_replicas(model: ModelLike, optimizer: OptimizerLike, devices: list[str],
                  build_on: Callable[[int, keras.Model], list[Any]] | None = None,
                  ) -> list[Replica]:  # fmt: skip
    """One replica per device, each a whole copy of the first; ``build_on(k, model_k)``: what
    replica k's optimizer is built for (default: the trainable variables).

    Raises:
        ValueError: the model is unbuilt, cannot be cloned, or has no trainable variables.
        TypeError: model or optimizer is of the wrong kind.
    """
    replicas: list[Replica] = []
    first: keras.Model | None = None
    for device in devices:
        made = new_model(model, device, first)
        if first is None:
            if not made.trainable_variables:
                raise ValueError("model has no trainable variables: there is nothing to train")
            first = made
        variables = made.trainable_variables if build_on is None else build_on(len(replicas), made)
        opt = new_optimizer(optimizer, variables, device, first=not replicas)
        replicas.append(Replica(device, made, opt))
    return replicas


def place(placement: Placement, model: ModelLike, optimizer: OptimizerLike,
          devices: Sequence[str], parameter_device: str) -> Replicas:  # fmt: skip
    """A trainer's replicas, made where ``placement`` puts them, all starting equal."""
    homes = placement.homes(devices, parameter_device)
    return Replicas(placement.make_replicas(model, optimizer, homes), placement)


def optimizer_state_bytes(trainer: Any) -> list[int]:
    """Bytes of optimizer state held per replica (``sharded`` over n: 1/n of replicated's)."""
    return [sharding.state_bytes(r.optimizer) for r in trainer.replicas]


def _values(variables: list[Any]) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in variables]


# -- the replicas kept one model: the towers' state combined, replica 0's changes followed --

AGGREGATIONS = ("mean", "none", "sum", "only_first_replica")
"""How :func:`combine_non_trainable` combines a variable's towers, by its Keras
``aggregation`` (``add_weight(aggregation=...)``):

=====================  ==================================================================
``mean``, ``none``     floating state: the mean over the towers that saw examples
``sum``                a running total: ``old + Σ_i (new_i − old)``, as one device adds
``only_first_replica`` tower 0's value
``none``, integer      a seed generator's state: tower 0's; other integer state is refused
=====================  ==================================================================
State no tower changed is kept bitwise (``(x + x + x) / 3`` is not always ``x``)."""


def _rule(variable: Any, value: tf.Tensor) -> str:
    """The rule of :data:`AGGREGATIONS` for a changed non-trainable ``variable`` (a
    ``ValueError`` for integer state with no declared aggregation)."""
    aggregation = str(getattr(variable, "aggregation", "none") or "none").lower()
    if aggregation in ("sum", "only_first_replica"):
        return aggregation
    if value.dtype.is_floating:
        return "mean"
    if "seed_generator_state" in (getattr(variable, "path", None) or variable.name):
        return "only_first_replica"
    name = getattr(variable, "path", None) or variable.name
    raise ValueError(
        f"non-trainable variable {name!r} ({value.dtype.name}) is changed by the towers, and "
        "an average of integers has no meaning: declare how its towers combine with "
        "add_weight(..., aggregation=...): 'sum' (a count each tower adds to), "
        "'only_first_replica' (tower 0's value) or 'mean'")


def combine_non_trainable(results: Sequence[Any], *, first_tower: bool, device: str,
                          variables: Sequence[Any] | None = None) -> list[tf.Tensor]:
    """One value per non-trainable variable, formed on ``device`` from every tower's
    :class:`~towers.tower.TowerResult` by its rule in :data:`AGGREGATIONS` (``variables``:
    replica 0's; None: all ``none``), or tower 0's for all when ``first_tower``.

    Raises:
        ValueError: changed integer state without a declared aggregation (when traced).
    """
    combined = []
    with tf.device(device):
        counts = [send(r.examples, device, note="state") for r in results]
        for j in range(len(results[0].non_trainable)):
            values = [r.non_trainable[j] for r in results]
            unchanged = all(r.changed is not None and r.changed[j] is False for r in results)
            if first_tower or unchanged:  # (known when traced)
                combined.append(send(values[0], device, note="state"))
                continue
            rule = (_rule(variables[j], values[0]) if variables is not None
                    else "mean" if values[0].dtype.is_floating else "only_first_replica")
            if rule == "only_first_replica":
                combined.append(send(values[0], device, note="state"))
            elif rule == "sum":
                old = tf.convert_to_tensor(variables[j].value) if variables else values[0]
                deltas = [send(v, device, note="state") - old for v in values]
                combined.append(old + reduce_on(deltas, device, "sum"))
            else:
                masked = [tf.where(c > 0, send(v, device, note="state"), tf.zeros_like(v))
                          for v, c in zip(values, counts)]  # fmt: skip
                seen = tf.add_n([tf.cast(c > 0, values[0].dtype) for c in counts])
                combined.append(reduce_on(masked, device, "sum") / seen)
    return combined


def _hyperparameters(optimizer: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """What a callback may change on an optimizer, by attribute path: its config minus its
    name and serialized objects (a schedule follows the same iterations everywhere); a
    wrapper's inner optimizer's under ``("inner_optimizer", ...)``."""
    found = {(*path, k): v for k, v in optimizer.get_config().items()
             if k != "name" and not isinstance(v, dict)}  # fmt: skip
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, keras.optimizers.Optimizer):
        found.update(_hyperparameters(inner, (*path, "inner_optimizer")))
    return found


def _layers(model: keras.Model) -> list[keras.layers.Layer]:  # Keras's own walk
    return list(model._flatten_layers(include_self=True, recursive=True))


def _copy_flags(source: keras.Model, target: keras.Model) -> None:
    """Give ``target`` (a clone) ``source``'s flags: parents first, as Keras cascades them."""
    for mine, theirs in zip(_layers(source), _layers(target)):
        if theirs.trainable != mine.trainable:
            theirs.trainable = mine.trainable
    for mine, theirs in zip(source.weights, target.weights):
        theirs.trainable = mine.trainable


class Follower:
    """Replica 0's trainable flags and optimizer hyperparameters as the step was last traced;
    :meth:`follow` brings every replica along (``placement``: the trainer's placement name;
    ``"sharded"`` cannot follow a change of flags)."""

    def __init__(self, replicas: Sequence[Any], placement: str) -> None:
        model = replicas[0].model
        self.placement = placement
        # a built model's layers and variables are fixed: walk them once, read flags per step
        self.watched = [*_layers(model), *model.weights]
        self.flags = tuple(bool(x.trainable) for x in self.watched)
        self.built = {id(v) for v in model.trainable_variables}
        self.seen = _hyperparameters(replicas[0].optimizer)

    def follow(self, trainer: Any) -> None:
        """Copy replica 0's changed flags (then rebuild the reducer and retrace) and changed
        hyperparameters (retrace unless only the learning rate, a variable every trace
        reads, changed) to every replica.

        Raises:
            ValueError: a flag changed under ``variables="sharded"``, every variable frozen,
                or a variable trainable now that was not when the trainer was built
                (nothing is changed then).
        """
        model, replicas = trainer.model, trainer.replicas
        flags = tuple(bool(x.trainable) for x in self.watched)
        if flags != self.flags:
            self._check(model)
            for replica in replicas[1:]:
                _copy_flags(model, replica.model)
            self.flags = flags
            trainer.reducer.build(model.trainable_variables, trainer.devices)
            trainer.retrace()
        now = _hyperparameters(trainer.optimizer)
        if now == self.seen:
            return
        changed = {path: v for path, v in now.items() if self.seen.get(path) != v}
        for replica in replicas[1:]:
            for path, value in changed.items():
                owner = replica.optimizer
                for name in path[:-1]:
                    owner = getattr(owner, name)
                setattr(owner, path[-1], value)
        if {path[-1] for path in changed} - {"learning_rate"}:
            trainer.retrace()
        self.seen = now

    def _check(self, model: keras.Model) -> None:
        if self.placement == "sharded":
            raise ValueError("variables='sharded' cannot follow a change of trainable after the "
                             "trainer was built: its shard plan and the owners' optimizer slots "
                             "are cut for the trainable variables it was built with. Set "
                             "layer.trainable before building the trainer, or use "
                             "variables='replicated' (or 'parameter_device'), which follow it")
        if not model.trainable_variables:
            raise ValueError("trainable: every variable of the model is frozen now, so a step "
                             "has nothing to train; unfreeze a layer (or stop calling train_step)")
        new = [v for v in model.trainable_variables if id(v) not in self.built]
        if new:
            names = ", ".join(getattr(v, "path", v.name) for v in new)
            raise ValueError(f"trainable: {names} became trainable but was not trainable when "
                             "the trainer was built, so its optimizer has no state for it. Build "
                             "the trainer with every layer you will train trainable (freezing "
                             "later is followed), or build a new trainer")
