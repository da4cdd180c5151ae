"""The capability table: which of a trainer's options compose, in one declarative place.

A trainer's options lie on a few axes. Any two values on two axes make a *cell*,
and every cell either works (tests/guard/test_capabilities.py trains it against
its reference) or is *refused*: :func:`check` raises a ``ValueError`` that names
both options, why they do not compose and what to use instead, when the trainer
is built and before any replica, variable or reducer state exists::

    axis           values
    trainer        TowerTrainer  WorkerTrainer  AsyncTrainer
    variables      parameter_device  replicated  sharded
    all_reduce     ring  registered  collective  bucketed  compressed  compressed+state
                   user  cross-worker
    optimizer      plain  loss_scale              (keras LossScaleOptimizer)
    on_nonfinite   skip  raise  ignore
    reduce_dtype   float32  compute
    sparse         gather  densify
    step_timeout   off  on
    semantics      one_device  mirrored       (towers.guard.semantics)
    check_replicas_every  off  on
    check_algorithm       on  off
    forward_graph         default  as_written   (towers.compile.step.FORWARD_GRAPHS)
    jit_compile           off  on     (XLA for each tower's forward/backward)
    loss_denominator      semantics  global  constant   (semantics: the semantics' divisor)

``all_reduce`` is classified by :func:`algorithm_kind`: ``ring`` is the registry's
ring with one sub-chunk (the only reduce-scatter ``sharded`` runs); ``registered``
any other registered hand-built algorithm; ``collective`` a registered one made of
TensorFlow collective ops (``nccl*``); ``compressed`` a codec without state
(fp16, bf16), ``compressed+state`` one with state (top-k and PowerSGD error
feedback); ``user`` a callable or reducer with no registry record;
``cross-worker`` the reducers of :mod:`towers.cluster`.

A trainer's cell is read from its options (:meth:`towers.guard.options.TowerOptions.cell`).
Refusals are data (:data:`REFUSALS`), one record per reason; the README's matrix
is :func:`markdown` of them. A few cells work only under a condition no axis shows
(:data:`LIMITS`: a ``WorkerTrainer``'s local reducer works with one worker); the
trainer checks it and refuses the rest itself. Defaults follow the placement and the algorithm
(:func:`default_all_reduce`, :func:`default_sparse`): ``variables="sharded"`` picks
``all_reduce="ring"``, the other placements ``"parameter_device"``; ``sparse`` is
``"densify"`` where a sparse gradient cannot stay sparse (``sharded``: a shard owner
updates a dense slice; a codec: it reduces every variable), else ``"gather"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from towers.allreduce.bucketed import Bucketed
from towers.allreduce.compressed import Compressed
from towers.allreduce.machinery.registry import algorithm_name, record_of

__all__ = [
    "AXES",
    "LIMITS",
    "REFUSALS",
    "Limit",
    "Refusal",
    "algorithm_kind",
    "check",
    "check_limits",
    "default_all_reduce",
    "default_sparse",
    "markdown",
    "refusal_for",
    "spell",
]

AXES: dict[str, tuple[str, ...]] = {
    "trainer": ("TowerTrainer", "WorkerTrainer", "AsyncTrainer"),
    "variables": ("parameter_device", "replicated", "sharded"),
    "all_reduce": (
        "ring", "registered", "collective", "bucketed", "compressed", "compressed+state",
        "user", "cross-worker",
    ),
    "optimizer": ("plain", "loss_scale"),
    "on_nonfinite": ("skip", "raise", "ignore"),
    "reduce_dtype": ("float32", "compute"),
    "sparse": ("gather", "densify"),
    "step_timeout": ("off", "on"),
    # what the step computes: one device's result or MirroredStrategy's (towers.guard.semantics)
    "semantics": ("one_device", "mirrored"),
    "check_replicas_every": ("off", "on"),
    "check_algorithm": ("on", "off"),
    # how the step is compiled (towers.compile.step.FORWARD_GRAPHS): the
    # towers' forward/backward under the caller's Grappler settings, or the whole step as
    # written; both run the same phases, so nothing is refused
    "forward_graph": ("default", "as_written"),
    "jit_compile": ("off", "on"),  # XLA for each tower's forward/backward (docs/xla.md)
    # what each tower divides its loss sum by: the semantics', the global batch, a constant
    "loss_denominator": ("semantics", "global", "constant"),
}
"""Every axis and its values, in the order the README's matrix shows them."""

COLLECTIVE_OPS = ("nccl", "nccl_ring", "nccl_tree")
"""Registered algorithms built from TensorFlow's collective ops (opaque to ``send``)."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One reason two options do not compose.

    Attributes:
        first, second: ``(axis, values)``: the cell is refused when the options hold
            one of ``first``'s values on its axis and one of ``second``'s on its.
        reason: why (what would go wrong, or what is not built).
        instead: what to use instead.
    """

    first: tuple[str, tuple[str, ...]]
    second: tuple[str, tuple[str, ...]]
    reason: str
    instead: str

    def matches(self, options: Mapping[str, str]) -> bool:
        """Whether ``options`` (axis -> value) fall in this refusal's cells."""
        return all(options.get(axis) in values for axis, values in (self.first, self.second))

    def message(self, options: Mapping[str, str], shown: Mapping[str, str] | None = None) -> str:
        """The error text: both options (``shown`` spells a value as the user passed it),
        the reason and the alternative."""
        def spell(axis: str) -> str:
            value = f"{axis}={options[axis]!r}"
            given = (shown or {}).get(axis)
            return value if given is None else f"{axis}={given} (a {options[axis]!r} kind)"

        (a, _), (b, _) = self.first, self.second
        return f"{spell(a)} with {spell(b)} is refused: {self.reason}; {self.instead}"


_NOT_RING = ("registered", "collective", "bucketed", "compressed", "compressed+state", "user",
             "cross-worker")

REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        ("trainer", ("WorkerTrainer",)), ("variables", ("sharded",)),
        "sharding reduce-scatters over one process's towers with towers' own ring, and the "
        "cross-worker reducers all-reduce whole gradients",
        "use variables='replicated' (or a TowerTrainer with variables='sharded' in one process)",
    ),
    Refusal(
        ("variables", ("sharded",)), ("all_reduce", _NOT_RING),
        "the sharded placement reduce-scatters with the ring's own phase and never calls "
        "another algorithm or wrapper (bucketing, compression, a user's reducer would be "
        "silently skipped)",
        "leave all_reduce unset (sharded uses the ring) or use variables='replicated' with "
        "this all_reduce",
    ),
    Refusal(
        ("variables", ("sharded",)), ("sparse", ("gather",)),
        "a shard owner updates a dense slice of every variable, so a sparse (Embedding) "
        "gradient cannot stay sparse",
        "pass sparse='densify', or leave it unset (sharded densifies where the optimizer's "
        "sparse and dense updates agree)",
    ),
    Refusal(
        ("variables", ("sharded",)), ("optimizer", ("loss_scale",)),
        "a LossScaleOptimizer decides to skip a step from whole gradients, and under the "
        "sharded placement each owner's optimizer sees only its shard",
        "use variables='replicated' (bitwise the same arithmetic, unsharded state)",
    ),
    Refusal(
        ("all_reduce", ("compressed", "compressed+state")), ("sparse", ("gather",)),
        "a codec is built with one state per variable and reduces every gradient, so a "
        "sparse (Embedding) gradient cannot be gathered beside it",
        "leave sparse unset (compressed reducers densify) or pass sparse='densify'",
    ),
    Refusal(
        ("trainer", ("WorkerTrainer",)), ("jit_compile", ("on",)),
        "XLA towers are built and measured in one process; a worker's step (its empty "
        "towers run the model on no examples) is not yet checked under XLA",
        "use jit_compile=False with WorkerTrainer, or a TowerTrainer in one process",
    ),
    Refusal(
        # a tutorial's GLOBAL_BATCH_SIZE counts every worker: not what one worker's shards give
        ("trainer", ("WorkerTrainer",)), ("loss_denominator", ("constant",)),
        "a worker divides by the global batch summed over workers; a constant denominator "
        "of one worker's shards would weigh the workers' examples differently",
        "leave loss_denominator unset (or 'global') across workers (or use a TowerTrainer "
        "in one process)",
    ),
    Refusal(
        ("trainer", ("WorkerTrainer",)), ("semantics", ("mirrored",)),
        "a worker divides by the global batch summed over workers and combines its state "
        "over its own towers; MirroredStrategy's per-replica divisor and first-tower state "
        "are a one-process comparison",
        "use semantics='one_device' across workers (or a TowerTrainer in one process)",
    ),
)
"""Every refused cell, one record per reason."""


@dataclasses.dataclass(frozen=True)
class Limit:
    """A cell that works under a condition the axes do not show; the trainer checks the
    condition itself and refuses what breaks it (``✓n`` in the matrix, with note n).

    Attributes:
        first, second: ``(axis, values)``, as for :class:`Refusal`.
        condition: when it works, and what is refused otherwise.
    """

    first: tuple[str, tuple[str, ...]]
    second: tuple[str, tuple[str, ...]]
    condition: str

    def matches(self, options: Mapping[str, str]) -> bool:
        """Whether ``options`` fall in this limit's cells."""
        return all(options.get(axis) in values for axis, values in (self.first, self.second))


_LOCAL = ("ring", "registered", "collective", "bucketed", "compressed", "compressed+state", "user")

LIMITS: tuple[Limit, ...] = (
    Limit(
        ("trainer", ("WorkerTrainer",)), ("all_reduce", _LOCAL),
        "with num_workers=1 only: across workers the reducer must be AllTowers (the default) "
        "or CrossWorker, and a local one is refused, naming num_workers (each worker would "
        "train alone)",
    ),
    Limit(
        ("trainer", ("TowerTrainer",)), ("all_reduce", ("cross-worker",)),
        "with op='mean' (each worker's loss is over its own batch: equal batches give the "
        "global mean) or one worker; op='sum' across workers is refused, naming op (it "
        "would multiply the gradient by the worker count; WorkerTrainer divides by the "
        "global batch and sums)",
    ),
    Limit(
        ("trainer", ("WorkerTrainer",)), ("semantics", ("one_device",)),
        "across workers a model with floating non-trainable state (BatchNormalization) is "
        "refused, naming the variables: it is combined over one worker's towers only, so "
        "the workers' copies would drift",
    ),
    Limit(
        ("variables", ("sharded",)), ("sparse", ("densify",)),
        "a model with a sparse-gradient layer (Embedding) and an optimizer whose update of a "
        "sparse gradient with repeated rows differs from its dense update (measured when the "
        "trainer is built: Adam, RMSprop, Adagrad, …; SGD and Lion agree) is refused, naming "
        "all three, unless sparse='densify' is passed explicitly (then it equals "
        "variables='replicated' with sparse='densify')",
    ),
    Limit(
        ("trainer", ("WorkerTrainer",)), ("sparse", ("gather", "densify")),
        "across workers a sparse (Embedding) gradient is refused when the step is traced: the "
        "cross-worker reducers take dense gradients",
    ),
)
"""Cells that work only under a condition the trainer checks (see :class:`Limit`)."""


def check_limits(options: Mapping[str, str], algorithm: Any) -> None:
    """The conditions of :data:`LIMITS` that only the resolved algorithm shows.

    Raises:
        ValueError: a ``TowerTrainer`` with a cross-worker reducer that sums over more
            than one worker (its loss is over this worker's batch only).
    """
    if options.get("trainer") == "TowerTrainer" and options.get("all_reduce") == "cross-worker":
        op, workers = getattr(algorithm, "op", "sum"), getattr(algorithm, "num_workers", 1)
        if op == "sum" and workers > 1:
            raise ValueError(
                f"all_reduce={algorithm!r} in a TowerTrainer: each worker's loss is over its "
                f"own batch, so summing over {workers} workers multiplies the gradient by "
                f"{workers}; use op='mean' (equal batches) or towers.cluster.WorkerTrainer")


def refusal_for(options: Mapping[str, str]) -> Refusal | None:
    """The first refusal whose cells hold ``options``, or None when they compose."""
    return next((r for r in REFUSALS if r.matches(options)), None)


def check(options: Mapping[str, str], shown: Mapping[str, str] | None = None) -> None:
    """Refuse a combination the table does not support.

    Args:
        options: axis -> value (see :data:`AXES`); axes left out are not checked.
        shown: axis -> the argument as the user gave it, for the message.

    Raises:
        ValueError: a value that is not on its axis, or a refused combination (the
            message names both options, the reason and the alternative).
    """
    for axis, value in options.items():
        if axis not in AXES or value not in AXES[axis]:
            raise ValueError(f"capabilities: {axis}={value!r} is not in the table {AXES.get(axis)}")
    refusal = refusal_for(options)
    if refusal is not None:
        raise ValueError(refusal.message(options, shown))


def default_all_reduce(variables: str, all_reduce: Any) -> Any:
    """``all_reduce``, or when unset (None) the placement's: the ring for ``sharded``."""
    if all_reduce is not None:
        return all_reduce
    return "ring" if variables == "sharded" else "parameter_device"


def default_sparse(variables: str, kind: str, sparse: str | None) -> str:
    """``sparse``, or when unset (None): ``"densify"`` where a sparse gradient cannot stay
    sparse (``sharded``; a codec), else ``"gather"`` (MirroredStrategy's)."""
    if sparse is not None:
        return sparse
    return "densify" if variables == "sharded" or kind.startswith("compressed") else "gather"


def _stateful(codec: Any) -> bool:
    """Whether a codec keeps state between steps (its ``init`` returns tensors)."""
    return bool(tf.nest.flatten(codec.init(tf.TensorShape([2]), tf.float32, 0)))


def algorithm_kind(algorithm: Any) -> str:
    """The ``all_reduce`` axis value of a resolved algorithm or reducer (see the module doc)."""
    if isinstance(algorithm, Compressed):
        return "compressed+state" if _stateful(algorithm.codec) else "compressed"
    if isinstance(algorithm, Bucketed):
        return "bucketed"
    if getattr(algorithm, "cross_worker", False):
        return "cross-worker"
    record = record_of(algorithm)
    if record is None:
        return "user"
    if record.name in COLLECTIVE_OPS:
        return "collective"
    if record.name == "ring" and record.params.get("subchunks", 1) == 1:
        return "ring"
    return "registered"


def spell(algorithm: Any) -> str:
    """An ``all_reduce`` argument as code would write it: ``compressed(ring, TopK)``, ``'tree'``."""
    if isinstance(algorithm, str):
        return repr(algorithm)
    if isinstance(algorithm, Compressed):
        return f"compressed({spell(algorithm.algorithm)}, {type(algorithm.codec).__name__})"
    if isinstance(algorithm, Bucketed):
        return f"bucketed({spell(algorithm.algorithm)}, {algorithm.bytes_per_bucket})"
    if record_of(algorithm) is not None:
        return repr(algorithm)  # with its parameters: ring(subchunks=2)
    return algorithm_name(algorithm)


ROW_AXES = ("trainer", "variables")
"""The matrix's columns: a trainer kind (TowerTrainer per placement) or another trainer."""

NOT_AN_OPTION: dict[str, tuple[str, ...]] = {
    "AsyncTrainer": ("variables", "all_reduce", "optimizer", "reduce_dtype", "sparse",
                     "step_timeout", "semantics", "check_replicas_every", "check_algorithm",
                     "forward_graph", "jit_compile", "loss_denominator"),
}
"""Axes a trainer kind has no argument for (its own fixed choice; shown as ``—``)."""



def _columns() -> list[tuple[str, dict[str, str]]]:
    cols = [(p, {"trainer": "TowerTrainer", "variables": p}) for p in AXES["variables"]]
    return cols + [(t, {"trainer": t}) for t in AXES["trainer"][1:]]


def markdown() -> str:
    """The capability table as a Markdown matrix: a row per option value, a column per
    trainer (``TowerTrainer`` by placement); ✓ works and is tested, ✓n works under note
    n's condition, ✗n refused (note n), — not an option of that trainer. Refused pairs
    not on the matrix follow as notes."""
    columns = _columns()
    notes: list[Refusal | Limit] = []
    lines = ["| option | " + " | ".join(label for label, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for axis in (a for a in AXES if a not in ROW_AXES):
        for value in AXES[axis]:
            cells = []
            for _, column in columns:
                cell = {**column, axis: value}
                refusal = refusal_for(cell)
                limit = next((m for m in LIMITS if m.matches(cell)), None)
                if axis in NOT_AN_OPTION.get(column["trainer"], ()):
                    cells.append("—")
                elif refusal is None and limit is None:
                    cells.append("✓")
                else:
                    record: Refusal | Limit = refusal or limit  # type: ignore[assignment]
                    if record not in notes:
                        notes.append(record)
                    mark = "✗" if refusal else "✓"
                    cells.append(f"{mark}{notes.index(record) + 1}")
            lines.append(f"| `{axis}={value}` | " + " | ".join(cells) + " |")
    lines.append("")
    for k, note in enumerate(notes, 1):
        text = note.condition if isinstance(note, Limit) else f"{note.reason}; {note.instead}"
        lines.append(f"{k}. {text}.")
    for k, refusal in enumerate((r for r in REFUSALS if r not in notes), len(notes) + 1):
        (a, va), (b, vb) = refusal.first, refusal.second
        scope = "" if "trainer" in (a, b) else " (any trainer)"
        lines.append(f"{k}. `{a}` ∈ {{{', '.join(va)}}} with `{b}` ∈ {{{', '.join(vb)}}}"
                     f"{scope}: {refusal.reason}; {refusal.instead}.")
    return "\n".join(lines)
