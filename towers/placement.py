"""Where the variables live: placements, and model and optimizer copies made there.

A *replica* is one (model, optimizer) pair whose variables sit on one device. A
:class:`Placement` says where the replicas live, which one each tower reads its
weights from, and which reduced gradients each replica applies::

    placement          homes                 tower i reads    replica k applies
    parameter_device   [parameter device]    replica 0        reduced[0] (all are equal)
    replicated         [tower 0 … n-1]       replica i        reduced[k]
    sharded            [tower 0 … n-1]       replica i        its chunk of every gradient
                                                              to its shard, then all-gather

The step asks the placement for the gradients (:meth:`Placement.reduce`), for one
:class:`Update` per optimizer (:meth:`Placement.updates`) and then to finish
(:meth:`Placement.finish`: ``sharded`` all-gathers; see
:mod:`towers.allreduce.machinery.sharding`).

All replicas start bitwise equal: later copies take every variable (seed-generator
state included) from the first. A new placement is one more subclass and one more
record in :data:`PLACEMENTS` (the registries' one record shape).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, TypeAlias, TypeVar

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.primitives import send
from towers.allreduce.machinery.registry import Record, Registry
from towers.allreduce.machinery.sharding import (
    ShardPlan,
    check_optimizer,
    dense_gradients,
    state_bytes,
)
from towers.devices import canonical_device
from towers.guard.given import check_devices, check_weights

__all__ = [
    "PLACEMENTS",
    "ModelLike",
    "OptimizerLike",
    "ParameterDevice",
    "Placement",
    "Replica",
    "Replicas",
    "Replicated",
    "Sharded",
    "Update",
    "check_devices",
    "check_weights",
    "first_model",
    "get_placement",
    "make_replicas",
    "optimizer_state_bytes",
    "place",
    "read_weights",
]

T = TypeVar("T")

ModelLike: TypeAlias = "keras.Model | Callable[[], keras.Model]"
OptimizerLike: TypeAlias = "keras.optimizers.Optimizer | Callable[[], keras.optimizers.Optimizer]"


@dataclasses.dataclass
class Replica:
    """One copy of the model and its optimizer, living on ``device``.

    ``sharded``: the optimizer holds slots for this replica's shard only (``sharded``).
    """

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

    def make_replicas(
        self, model: ModelLike, optimizer: OptimizerLike, homes: list[str], all_reduce: Any
    ) -> list[Replica]:
        """The trainer's replicas, one per home (``all_reduce``: the resolved algorithm)."""
        return make_replicas(model, optimizer, homes)

    def reduce(self, reducer: Any, grads: list[list[Any]]) -> list[list[Any]]:
        """``grads[tower][var]`` -> what each replica applies (default: all-reduce, then pick)."""
        return self.for_replicas(reducer.reduce_gradients(grads))

    def updates(self, replicas: Sequence[Replica], reduced: list[list[Any]]) -> list[Update]:
        """The optimizer updates of one step (default: every replica applies its gradients)."""
        return [
            Update(r.device, r.optimizer, list(g), list(r.model.trainable_variables))
            for r, g in zip(replicas, reduced)
        ]

    def finish(self, replicas: Sequence[Replica]) -> None:
        """After the updates (default: nothing; ``sharded`` all-gathers the parameters)."""

    def covering(self, reduced: list[list[Any]]) -> list[Any]:
        """One copy of every reduced gradient element (default: the first replica's, as
        every replica receives the whole sum; ``sharded``: every owner's shards)."""
        return list(reduced[0])

    def homes(self, devices: Sequence[str], parameter_device: str) -> list[str]:
        """The device of each replica (one replica per entry)."""
        raise NotImplementedError

    def replica_of(self, tower: int) -> int:
        """The replica whose weights tower ``tower`` reads."""
        raise NotImplementedError

    def for_replicas(self, reduced: list[T]) -> list[T]:
        """``reduced[tower]`` (the all-reduce's outputs) -> what each replica applies."""
        raise NotImplementedError


class ParameterDevice(Placement):
    """One copy on the parameter device (CentralStorageStrategy's layout)."""

    name = "parameter_device"

    def homes(self, devices: Sequence[str], parameter_device: str) -> list[str]:
        return [parameter_device]

    def replica_of(self, tower: int) -> int:
        return 0

    def for_replicas(self, reduced: list[T]) -> list[T]:
        # Every output holds the same sum; the unused copies are pruned from the graph.
        return reduced[:1]


class Replicated(Placement):
    """One copy per tower, all updated identically (MirroredStrategy's layout)."""

    name = "replicated"

    def homes(self, devices: Sequence[str], parameter_device: str) -> list[str]:
        return list(devices)

    def replica_of(self, tower: int) -> int:
        return tower

    def for_replicas(self, reduced: list[T]) -> list[T]:
        return list(reduced)


class Sharded(Replicated):
    """One weight copy per tower; tower k owns chunk k of every gradient and optimizer slot.

    Gradients are ring reduce-scattered, each owner's optimizer (built for its shard
    only) updates it, and the shards are all-gathered into every replica (ZeRO 1–2;
    :mod:`towers.allreduce.machinery.sharding`). Bitwise equal to ``replicated`` with
    ``all_reduce="ring"``. One instance per trainer: it holds the :class:`ShardPlan`.
    """

    name = "sharded"

    def __init__(self) -> None:
        self.plan = ShardPlan([])

    def make_replicas(
        self, model: ModelLike, optimizer: OptimizerLike, homes: list[str], all_reduce: Any
    ) -> list[Replica]:
        """Replicas whose optimizers hold slots only for their own shards.

        Raises:
            ValueError: the optimizer is not elementwise. (Which all-reduce composes with
                this placement is the capability table's: only the ring.)
        """
        self.plan = ShardPlan(homes)
        replicas = make_replicas(model, optimizer, homes, build_on=self.plan.shards_for)
        check_optimizer(replicas[0].optimizer)
        return [dataclasses.replace(r, sharded=True) for r in replicas]

    def reduce(self, reducer: Any, grads: list[list[Any]]) -> list[list[Any]]:
        """``grads[tower][var]`` -> ``owned[owner][var]`` (None where a shard is empty)."""
        return self.plan.reduce_scatter(dense_gradients(grads))

    def updates(self, replicas: Sequence[Replica], reduced: list[list[Any]]) -> list[Update]:
        """Refresh each owner's shard from its replica; one update per owner with a shard."""
        self.plan.load(replicas)
        return [
            Update(replicas[k].device, replicas[k].optimizer, grads, shards)
            for k, (grads, shards) in enumerate(self.plan.pairs(reduced))
            if shards
        ]

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
"""The placements ``TowerTrainer(variables=...)`` accepts, by name
(:class:`~towers.allreduce.machinery.registry.Record` s of kind ``placement``);
``PLACEMENTS[name]()``
makes a new one (``sharded`` holds its trainer's plan)."""


def get_placement(name: str | Placement) -> Placement:
    """The placement called ``name`` (a :class:`Placement` passes through).

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(name, Placement):
        return name
    if name not in PLACEMENTS:
        raise ValueError(f"variables must be one of {', '.join(PLACEMENTS)}; got {name!r}")
    placement: Placement = PLACEMENTS[name]()
    return placement


def _on_device(model: keras.Model, device: str) -> bool:
    return all(canonical_device(v.value.device) == device for v in model.variables)


def _new_model(model: ModelLike, device: str, first: keras.Model | None) -> keras.Model:
    with tf.device(device):
        if isinstance(model, keras.Model):
            if first is None and model.built and _on_device(model, device):
                return model
            if not model.built:
                raise ValueError(
                    "model is not built: give it an Input (keras.Input) or call it once, "
                    "or pass a zero-argument factory that returns a built model"
                )
            try:
                made = keras.models.clone_model(model)
            except Exception as err:  # subclassed models may not clone
                raise ValueError(
                    "model could not be cloned onto the towers' devices: pass a zero-argument "
                    f"factory that builds it instead ({err})"
                ) from err
            source: keras.Model = first or model
        elif callable(model):
            made = model()
            if not isinstance(made, keras.Model):
                raise TypeError(f"model factory must return a keras.Model, got {type(made)}")
            if not made.built:
                raise ValueError("the model factory must return a built model (use keras.Input)")
            source = first if first is not None else made
        else:
            raise TypeError(f"model must be a keras.Model or a factory, got {type(model)}")
        _copy_variables(source, made)
    return made


def first_model(model: ModelLike, device: str) -> keras.Model:
    """The model replica 0 will hold on ``device``: ``model`` itself when its variables live
    there, else a copy made there (what :func:`make_replicas` does for its first replica).

    Raises:
        TypeError, ValueError: as :func:`make_replicas`.
    """
    return _new_model(model, device, None)


def _copy_variables(source: keras.Model, target: keras.Model) -> None:
    if source is target:
        return
    if len(source.variables) != len(target.variables):
        raise ValueError("model copies differ in their variables: the factory is not deterministic")
    for s, t in zip(source.variables, target.variables):
        t.assign(np.asarray(s.numpy()))


def _new_optimizer(
    optimizer: OptimizerLike, variables: list[Any], device: str, first: bool
) -> keras.optimizers.Optimizer:
    with tf.device(device):
        if isinstance(optimizer, keras.optimizers.Optimizer):
            if first and not optimizer.built:
                made = optimizer
            else:
                made = type(optimizer).from_config(optimizer.get_config())
        elif callable(optimizer):
            made = optimizer()
            if not isinstance(made, keras.optimizers.Optimizer):
                raise TypeError(
                    f"optimizer factory must return a keras optimizer, got {type(made)}"
                )
        else:
            raise TypeError(f"optimizer must be a Keras optimizer or a factory, got {optimizer!r}")
        made.build(variables)
    return made


def make_replicas(
    model: ModelLike,
    optimizer: OptimizerLike,
    devices: list[str],
    build_on: Callable[[int, keras.Model], list[Any]] | None = None,
) -> list[Replica]:
    """Create one replica per device in ``devices``, all starting from the same values.

    ``build_on(k, model_k)`` gives the variables replica ``k``'s optimizer is built
    for (default: the model's trainable variables; ``sharded``: its shard variables).

    Raises:
        ValueError: the model is unbuilt, cannot be cloned, or has no trainable variables.
        TypeError: model or optimizer is of the wrong kind.
    """
    replicas: list[Replica] = []
    first: keras.Model | None = None
    for device in devices:
        made = _new_model(model, device, first)
        if first is None:
            if not made.trainable_variables:
                raise ValueError("model has no trainable variables: there is nothing to train")
            first = made
        variables = made.trainable_variables if build_on is None else build_on(len(replicas), made)
        opt = _new_optimizer(optimizer, variables, device, first=not replicas)
        replicas.append(Replica(device, made, opt))
    return replicas


class Replicas(list[Replica]):
    """A trainer's replicas (a list, replica 0 first) and the placement that made them."""

    def __init__(self, replicas: list[Replica], placement: Placement) -> None:
        super().__init__(replicas)
        self.placement = placement

    def get_weights(self) -> list[np.ndarray]:
        """Replica 0's weights as NumPy arrays, in ``model.weights`` order."""
        return variable_values(self[0].model.weights)

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Set every replica's weights (``model.weights`` order), all or nothing.

        Raises:
            TypeError, ValueError: a wrong count, shape or dtype (naming the index).
        """
        arrays = check_weights(self[0].model.weights, weights)
        for replica in self:
            for variable, value in zip(replica.model.weights, arrays):
                variable.assign(value)

    def weights(self) -> list[list[np.ndarray]]:
        """Every replica's weights (one list per replica)."""
        return [variable_values(r.model.weights) for r in self]

    def state_variables(self, reducer: Any) -> list[tf.Variable]:
        """Every variable an update may change, each once (replicas' and reducer's)."""
        found = [v for r in self for v in (*r.model.variables, *r.optimizer.variables)]
        dense = reducer.dense
        found += list(dense.variables) if isinstance(dense, tf.Module) else []
        return list({id(v): v for v in found}.values())


def place(placement: Placement, model: ModelLike, optimizer: OptimizerLike,
          devices: Sequence[str], parameter_device: str, all_reduce: Any) -> Replicas:
    """A trainer's replicas, made where ``placement`` puts them, all starting equal."""
    homes = placement.homes(devices, parameter_device)
    return Replicas(placement.make_replicas(model, optimizer, homes, all_reduce), placement)


def optimizer_state_bytes(trainer: Any) -> list[int]:
    """Bytes of optimizer state (slots, iteration count, learning rate) held per replica.

    Example:
        >>> optimizer_state_bytes(trainer)      # sharded over 4: ≈ 1/4 of replicated each
    """
    return [state_bytes(r.optimizer) for r in trainer.replicas]


def variable_values(variables: list[Any]) -> list[np.ndarray]:
    """NumPy copies of a list of Keras variables."""
    return [np.asarray(v.numpy()) for v in variables]


def read_weights(replica: Replica, device: str) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """Read a replica's trainable and non-trainable values and move them onto ``device``."""
    with tf.device(replica.device):
        trainable = [tf.convert_to_tensor(v.value) for v in replica.model.trainable_variables]
        frozen = [tf.convert_to_tensor(v.value) for v in replica.model.non_trainable_variables]
    src = replica.device
    return (
        [send(t, device, src=src, note="read-weights") for t in trainable],
        [send(t, device, src=src, note="read-weights") for t in frozen],
    )
