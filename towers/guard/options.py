"""``TowerOptions``: a trainer's options, written once and checked once.

``TowerTrainer``, ``TowerModel`` and ``WorkerTrainer`` hand the same keyword arguments to
:meth:`TowerOptions.of`: each value checked (a wrong one raises naming the argument), one
frozen object, whose cell of the capability table (:mod:`towers.guard.capabilities`)
refuses the combinations that do not compose.

Example:
    >>> TowerOptions.of("TowerTrainer", {"variables": "replicated"}).semantics
    'one_device'
    >>> TowerOptions.of("TowerTrainer", {"semantic": "mirrored"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: TowerTrainer got an unexpected option 'semantic'; its options are all_reduce, ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from towers.allreduce.machinery.primitives import Recorder, StepStats
from towers.allreduce.machinery.reducer import SPARSE, as_reducer
from towers.allreduce.machinery.registry import algorithm_name
from towers.allreduce.machinery.resolve import get
from towers.allreduce.machinery.tf_collective_ops import token
from towers.compile.step import FORWARD_GRAPHS, CompiledStep
from towers.guard import capabilities
from towers.guard.arguments import check_bool, check_choice, naming, optional, positive_int
from towers.guard.deadline import Deadline
from towers.guard.given import check_devices, check_layers
from towers.guard.inputs import check_kinds
from towers.guard.loss_scale import REDUCE_DTYPES, LossScale, is_loss_scaled
from towers.guard.nonfinite import NONFINITE, Guard
from towers.guard.reduces import check_sums
from towers.guard.replicas import ReplicaCheck
from towers.guard.semantics import SEMANTICS, check_constant, check_semantics, in_mirrored_order
from towers.placement import Follower, Replicas, get_placement, place
from towers.tower import LossFn
from towers.training.keras_copies import ModelLike, OptimizerLike
from towers.training.losses import bind_loss, reduction_of, step_loss

__all__ = ["TowerOptions", "TrainerParts"]

_NOT_OPTIONS = {
    "non_trainable": "non-trainable state follows semantics: 'one_device' (default) averages "
                     "it over the towers, 'mirrored' keeps the first tower's",
}


@dataclasses.dataclass(frozen=True)
class TowerOptions:
    """Every option of a trainer, checked; the arguments of ``TowerTrainer`` and ``TowerModel``.

    Attributes:
        all_reduce: a name from ``towers.ALGORITHMS`` (or ``module:NAME``), an algorithm
            callable or a ``GradientReducer``. None follows the placement: ``"ring"`` for
            ``sharded``, ``"parameter_device"`` otherwise.
        variables: ``"parameter_device"`` (one copy, updated on the parameter device;
            CentralStorageStrategy's layout), ``"replicated"`` (one copy per tower, all
            updated identically; MirroredStrategy's layout) or ``"sharded"`` (one copy per
            tower, optimizer state and gradients sharded over the towers, ZeRO 1–2; it runs
            the ring's reduce-scatter; :mod:`towers.allreduce.machinery.sharding`).
        parameter_device: where the single copy lives (default: the first tower).
        semantics: what the step computes (:mod:`towers.guard.semantics`).
            ``"one_device"`` (default): what one device computes on the whole batch (state
            averaged over the towers, the loss over the global batch, clipping on the sum).
            ``"mirrored"``: what Keras 3 under ``MirroredStrategy`` observably does (tower
            0's non-trainable state, each tower's loss divided by its shard size × towers,
            clipping applied to each tower's share), for exact comparisons.
        sparse: ``"gather"`` (keep ``IndexedSlices``, concatenated in tower order, as
            MirroredStrategy does) or ``"densify"`` (dense all-reduce of sparse gradients).
            None follows the placement: ``"densify"`` for ``sharded`` (a shard owner
            updates a dense slice) and codecs, ``"gather"`` otherwise.
        on_nonfinite: ``"skip"`` (default: a step whose loss, gradients or state hold a
            NaN/Inf on any tower changes nothing and is counted), ``"raise"`` (the same,
            then ``NonFiniteError``) or ``"ignore"`` (apply whatever comes, as
            tf.distribute does): :mod:`towers.guard.nonfinite`.
        step_timeout: seconds a step may run, then ``StepTimeout`` (:mod:`towers.guard.deadline`).
            None (default): the algorithm's ``timeout_seconds`` (``nccl``: 60 s) if any.
        check_replicas_every: compare the replicas' checksums every k steps (None: never).
        reduce_dtype: ``"float32"`` (default) or ``"compute"`` (the model's dtype policy's
            compute dtype) for the gradient all-reduce (:mod:`towers.guard.loss_scale`,
            docs/mixed_precision.md).
        check_algorithm: run a user's algorithm (no registry record) once on small values
            and refuse it unless every output is the sum of the inputs
            (:mod:`towers.guard.reduces`). False skips it (a lossy compression of yours).
        loss_denominator: what every tower divides its loss sum by, when it is not the
            semantics' divisor (None, default): ``"global"`` (the global batch: a custom
            loop passing ``global_batch_size``) or a positive number (an older tutorial's
            constant ``GLOBAL_BATCH_SIZE``).
        forward_graph: ``"default"`` (the towers under the caller's Grappler settings, as
            tf.distribute's, the reduction and update as written) or ``"as_written"`` (the
            whole step so): :data:`~towers.compile.step.FORWARD_GRAPHS`.
        jit_compile: compile each tower's forward and backward pass with XLA (one cluster
            per tower); the reduction and update stay as written (docs/xla.md).
    """

    all_reduce: Any = None
    variables: Any = "parameter_device"
    parameter_device: str | None = None
    semantics: str = "one_device"
    sparse: str | None = None
    on_nonfinite: str = "skip"
    step_timeout: float | None = None
    check_replicas_every: int | None = None
    reduce_dtype: str = "float32"
    check_algorithm: bool = True
    loss_denominator: str | float | None = None
    forward_graph: str = "default"
    jit_compile: bool = False

    def __post_init__(self) -> None:
        check_choice("semantics", self.semantics, SEMANTICS)
        if self.sparse is not None:
            check_choice("sparse", self.sparse, SPARSE)
        check_choice("on_nonfinite", self.on_nonfinite, NONFINITE)
        seconds = self.step_timeout
        number = isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
        if seconds is not None and not (number and seconds > 0):
            raise ValueError(f"step_timeout must be None or seconds > 0; got {seconds!r}")
        optional(positive_int, "check_replicas_every", self.check_replicas_every)
        check_choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        check_bool("check_algorithm", self.check_algorithm)
        object.__setattr__(self, "loss_denominator", check_constant(self.loss_denominator))
        check_choice("forward_graph", self.forward_graph, FORWARD_GRAPHS)
        check_bool("jit_compile", self.jit_compile)

    @classmethod
    def of(cls, caller: str, given: Mapping[str, Any]) -> TowerOptions:
        """The options ``given`` as keyword arguments to ``caller``, checked.

        Raises:
            TypeError: an argument that is not an option (naming it and the options);
                one that ``semantics`` covers names it.
            ValueError, TypeError: a value that is not one of its option's (naming it).
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in given:
            if key in _NOT_OPTIONS:
                raise TypeError(f"{caller}: {key}= is not an option; {_NOT_OPTIONS[key]}")
            if key not in names:
                raise TypeError(f"{caller} got an unexpected option {key!r}; its options are "
                                f"{', '.join(names)}")  # fmt: skip
        if given.get("loss_denominator") == "per_replica":
            raise ValueError(f"{caller}: loss_denominator='per_replica' is semantics='mirrored' "
                             "(each tower's loss divided by its own shard size × towers, as "
                             "compute_average_loss without global_batch_size divides)")
        return cls(**given)

    @property
    def divisor(self) -> str | float:
        """What every tower divides its loss sum by: ``"global"`` (the global batch),
        ``"per_replica"`` (its shard size × towers: ``"mirrored"``'s) or a constant."""
        if self.loss_denominator is None:
            return "per_replica" if self.semantics == "mirrored" else "global"
        return self.loss_denominator

    def arguments(self) -> dict[str, Any]:
        """The options as keyword arguments (``TowerModel``'s config, a trainer's)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def cell(self, trainer: str, variables: str, kind: str, sparse: str,
             loss_scaled: bool) -> dict[str, str]:  # fmt: skip
        """This trainer's cell of the capability table (:data:`~towers.guard.capabilities.AXES`).

        Args:
            trainer: the trainer's kind (``TowerTrainer``, ``WorkerTrainer``).
            variables: the placement's name.
            kind: the resolved algorithm's kind (:func:`~towers.guard.capabilities.algorithm_kind`).
            sparse: the resolved ``sparse`` (:func:`~towers.guard.capabilities.default_sparse`).
            loss_scaled: the optimizer is a ``LossScaleOptimizer``.
        """
        def on(value: Any) -> str:
            return "off" if value is None or value is False else "on"

        return {
            "trainer": trainer, "variables": variables, "all_reduce": kind,
            "optimizer": "loss_scale" if loss_scaled else "plain",
            "on_nonfinite": self.on_nonfinite, "reduce_dtype": self.reduce_dtype,
            "sparse": sparse, "step_timeout": on(self.step_timeout),
            "semantics": self.semantics, "check_replicas_every": on(self.check_replicas_every),
            "check_algorithm": on(self.check_algorithm),
            "loss_denominator": "semantics" if self.loss_denominator is None else "global"
            if self.loss_denominator == "global" else "constant",
            "forward_graph": self.forward_graph, "jit_compile": on(self.jit_compile),
        }  # fmt: skip


class TrainerParts:
    """What a trainer is made of (``options``, ``devices``, ``placement``, ``replicas``, replica
    0's ``model`` and ``optimizer``, the loss, ``reducer``, ``deadline``, ``guard``,
    ``loss_scale``, ``replica_check``, ``compiled``), checked before anything exists; and
    what one reads of it between steps."""

    across_processes: Any = None  # a multi-process trainer's method: the guard's counts summed
    synchronized: list[str]  # its BatchNormalization(synchronized=True) layers: towers meet there

    def __init__(self, model: ModelLike, optimizer: OptimizerLike,
                 loss: str | LossFn | keras.losses.Loss, devices: Sequence[str] | None = None,
                 **options: Any) -> None:  # fmt: skip
        check_kinds(model, optimizer, loss)
        self.options = o = TowerOptions.of(type(self).__name__, options)
        self.divisor_rule = o.divisor  # "global", "per_replica" or a constant
        self.devices = naming("devices", lambda: check_devices(devices))
        self.placement = naming("variables", lambda: get_placement(o.variables))
        all_reduce = capabilities.default_all_reduce(self.placement.name, o.all_reduce)
        self.parameter_device = naming(
            "parameter_device", lambda: check_devices([o.parameter_device or self.devices[0]])[0])
        self.loss_fn = step_loss(loss)  # bound to the model's outputs below
        self.loss_reduction = reduction_of(loss)
        made = callable(optimizer) and not isinstance(optimizer, keras.optimizers.Optimizer)
        kind_of_optimizer = optimizer() if made else optimizer  # a factory: called to learn
        check_semantics(o.semantics, o.divisor, self.loss_reduction, kind_of_optimizer)
        reducer = naming("all_reduce", lambda: get(all_reduce,
                                                   parameter_device=self.parameter_device))
        kind = capabilities.algorithm_kind(reducer)
        self.sparse = capabilities.default_sparse(self.placement.name, kind, o.sparse)
        trainer = type(self).__name__
        self.cell = o.cell(trainer if trainer in capabilities.AXES["trainer"] else "TowerTrainer",
                           self.placement.name, kind, self.sparse,
                           is_loss_scaled(kind_of_optimizer))  # fmt: skip
        capabilities.check(self.cell, {"all_reduce": capabilities.spell(all_reduce)}, reducer)
        seconds = o.step_timeout or getattr(reducer, "timeout_seconds", None)
        self.deadline = Deadline(seconds, algorithm_name(reducer), self.parameter_device)
        self.timed = seconds is not None or kind not in ("registered", "ring")  # else: copies
        self.algorithm: Any = reducer
        self.replica_check = ReplicaCheck(o.check_replicas_every)
        self.reducer = as_reducer(reducer, sparse=self.sparse)
        self.replicas: Replicas = place(self.placement, model, optimizer, self.devices,
                                        self.parameter_device)  # fmt: skip
        self.model, self.optimizer = self.replicas[0].model, self.replicas[0].optimizer
        self._build_step(reducer, loss)

    def _build_step(self, reducer: Any, loss: Any) -> None:
        """The loss, the reducer, the loss scale and the guard, on the built replicas."""
        o, first, n = self.options, self.replicas[0], len(self.devices)
        if o.semantics == "mirrored":  # the sum adds in MirroredStrategy's order
            self.reducer.per_tensor = in_mirrored_order(reducer, first.model.name, n)
        self.synchronized = check_layers(first.model, first.optimizer, n, self.cell, o.sparse)
        for device in self.devices if self.synchronized else ():  # not made mid-trace
            token(device)  # (a tower empty in the first batch joins in a later trace)
        self.loss_fn = bind_loss(self.loss_fn, loss, first.model)
        self.reducer.build(first.model.trainable_variables, self.devices)
        self.loss_scale = LossScale(first.optimizer, first.model, o.reduce_dtype)
        if o.check_algorithm:  # a user's algorithm must sum (the registry's are proved)
            check_sums(reducer, self.devices, first.model.trainable_variables,
                       self.loss_scale.wire_dtype, o.step_timeout)  # fmt: skip
        self.guard = Guard(o.on_nonfinite, n, self.parameter_device, self.loss_scale.active,
                           agree=self.across_processes)  # fmt: skip
        self._reduce_first = o.on_nonfinite != "ignore" and capabilities.sums_exactly(
            reducer, self.placement.name)
        self.trace_count = 0
        self.last_trace_stats: Recorder | None = None
        self.follower = Follower(self.replicas, self.placement.name)
        self.compiled = CompiledStep(self)

    def retrace(self) -> None:
        """Trace the step again on its next call (a changed Python hyperparameter)."""
        self.compiled = CompiledStep(self)

    @property
    def last_step_stats(self) -> StepStats | None:
        """One step's communication (bytes per tower and link, ticks), counted at ``send``."""
        stats = self.last_trace_stats
        return None if stats is None else StepStats.from_recorder(stats)

    @property
    def on_nonfinite(self) -> str:
        """What a step with a NaN or Inf does: ``"skip"``, ``"raise"`` or ``"ignore"``."""
        return self.guard.mode

    @property
    def skipped_steps(self) -> int:
        """How many steps the non-finite guard skipped."""
        return int(self.guard.skipped.numpy())

    @property
    def last_step_nonfinite(self) -> dict[int, list[str]]:
        """``{tower: ["loss", "gradients", …]}`` of the last step (empty: not skipped)."""
        return self.guard.last()

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights as NumPy arrays, in ``model.weights`` order."""
        return self.replicas.get_weights()

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Set every replica's weights, all or nothing (:meth:`Replicas.set_weights`)."""
        self.replicas.set_weights(weights)

    def replica_weights(self) -> list[list[np.ndarray]]:
        """Every replica's weights (one list per replica)."""
        return self.replicas.weights()
