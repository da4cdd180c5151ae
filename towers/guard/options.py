"""``TowerOptions``: a trainer's options, written once and checked once.

``TowerTrainer``, ``TowerModel`` and the cluster's ``WorkerTrainer`` take the same
keyword arguments; each hands them to :meth:`TowerOptions.of`, which checks every value
on its own (a wrong one raises naming the argument) and returns one frozen object. The
trainer then reads its cell of the capability table from it (:meth:`TowerOptions.cell`,
:mod:`towers.guard.capabilities`), which refuses the combinations that do not compose.

Example:
    >>> TowerOptions.of("TowerTrainer", {"variables": "replicated"}).semantics
    'one_device'
    >>> TowerOptions.of("TowerTrainer", {"semantic": "mirrored"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: TowerTrainer got an unexpected option 'semantic'; its options are all_reduce, ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from towers.allreduce.machinery.reducer import SPARSE
from towers.compile.step import FORWARD_GRAPHS
from towers.guard.arguments import check_bool, check_choice, optional, positive_int
from towers.guard.loss_scale import REDUCE_DTYPES
from towers.guard.nonfinite import NONFINITE
from towers.guard.semantics import SEMANTICS, check_constant

__all__ = ["TowerOptions"]

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
            ``"one_device"`` (default): what one device computes on the whole batch —
            non-trainable state averaged over the towers, every tower's loss divided by
            the global batch, gradient clipping on the reduced gradient. ``"mirrored"``:
            what Keras 3 under ``MirroredStrategy`` observably does — tower 0's
            non-trainable state, each tower's loss divided by its own shard size × towers
            (``compute_average_loss`` without ``global_batch_size``), the optimizer's
            ``clipnorm``/``global_clipnorm``/``clipvalue`` applied to each tower's share
            before the all-reduce — for exact comparisons.
        sparse: ``"gather"`` (keep ``IndexedSlices``, concatenated in tower order, as
            MirroredStrategy does) or ``"densify"`` (dense all-reduce of sparse gradients).
            None follows the placement: ``"densify"`` for ``sharded`` (a shard owner
            updates a dense slice) and codecs, ``"gather"`` otherwise.
        on_nonfinite: ``"skip"`` (default: a step whose loss, gradients or state hold a
            NaN/Inf on any tower changes nothing and is counted), ``"raise"`` (the same,
            then ``NonFiniteError``) or ``"ignore"`` (apply whatever comes, as
            tf.distribute does): :mod:`towers.guard.nonfinite`.
        step_timeout: seconds a step may run, then ``StepTimeout``
            (:mod:`towers.guard.deadline`). None (default): no deadline.
        check_replicas_every: compare the replicas by checksum every k steps
            (:mod:`towers.training.sync`). None (default): never.
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
        forward_graph: ``"default"`` (the towers' forward/backward compile under the
            caller's Grappler settings, as tf.distribute's replica step does, and only the
            reduction and update as written) or ``"as_written"`` (the whole step in one
            function with Grappler's rewrites off):
            :data:`~towers.compile.step.FORWARD_GRAPHS`.
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
            "semantics": self.semantics,
            "check_replicas_every": on(self.check_replicas_every),
            "check_algorithm": on(self.check_algorithm),
            "loss_denominator": _denominator_axis(self.loss_denominator),
            "forward_graph": self.forward_graph, "jit_compile": on(self.jit_compile),
        }  # fmt: skip


def _denominator_axis(value: str | float | None) -> str:
    """The capability table's ``loss_denominator`` value: semantics, global or constant."""
    return "semantics" if value is None else "global" if value == "global" else "constant"
