"""The capability table: which of a trainer's options compose, as data and a short reader.

A *cell* (a value on each of two :data:`AXES`) works, works under a condition the trainer
checks (:data:`LIMITS`), or is refused before any state exists (:data:`REFUSALS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from towers.allreduce.bucketed import Bucketed
from towers.allreduce.compressed import Compressed
from towers.allreduce.machinery.registry import ALGORITHMS, algorithm_name, record_of

__all__ = [
    "AXES", "LIMITS", "REFUSALS", "Rule", "algorithm_kind", "check",
    "default_all_reduce", "default_sparse", "markdown", "refusal_for", "spell", "sums_exactly"]

AXES: dict[str, tuple[str, ...]] = {
    "trainer": ("TowerTrainer", "WorkerTrainer", "AsyncTrainer"),
    "variables": ("parameter_device", "replicated", "sharded"),
    # the resolved algorithm's kind: algorithm_kind()
    "all_reduce": ("ring", "registered", "collective", "bucketed", "compressed",
                   "compressed+state", "user", "cross-worker"),
    "optimizer": ("plain", "loss_scale"),  # loss_scale: keras's LossScaleOptimizer
    "on_nonfinite": ("skip", "raise", "ignore"),
    "reduce_dtype": ("float32", "compute"),
    "sparse": ("gather", "densify"),
    "step_timeout": ("off", "on"),
    "semantics": ("one_device", "mirrored"),
    "check_replicas_every": ("off", "on"),
    "check_algorithm": ("on", "off"),
    "forward_graph": ("default", "as_written"),
    "jit_compile": ("off", "on"),
    "loss_denominator": ("semantics", "global", "constant"),
    # the model's BatchNormalization: synchronized=True over more than one tower, or not
    "batch_norm": ("per_tower", "synchronized"),
}  # fmt: skip
"""Every axis and its values, in the order the matrix shows them."""

COLLECTIVE_OPS = ("nccl", "nccl_ring", "nccl_tree")
"""Registered algorithms built from TensorFlow's collective ops (opaque to ``send``)."""

OPTIONS_OF = {"AsyncTrainer": ("on_nonfinite",)}
"""The only axes a trainer kind takes, where it does not take them all (others: ``—``)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """A refused pair of options, or one that works under a condition: ``(axis, values)`` each."""

    first: tuple[str, tuple[str, ...]]
    second: tuple[str, tuple[str, ...]]
    text: str

    def matches(self, options: Mapping[str, str]) -> bool:
        """Whether ``options`` (axis -> value) fall in this rule's cells."""
        return all(options.get(axis) in values for axis, values in (self.first, self.second))


def _rules(*rows: tuple[str, str, str]) -> tuple[Rule, ...]:
    """Rows ``("axis=v w", "axis!=v", text)``: ``=`` those values, ``!=`` every other."""
    def side(spec: str) -> tuple[str, tuple[str, ...]]:
        axis, _, values = spec.partition("=")
        if axis.endswith("!"):
            axis = axis[:-1]
            return axis, tuple(v for v in AXES[axis] if v not in values.split())
        return axis, tuple(values.split())

    return tuple(Rule(side(a), side(b), text) for a, b, text in rows)


REFUSALS = _rules(
    ("trainer=WorkerTrainer", "variables=sharded",
     "sharding reduce-scatters with towers' own ring within one process, and the "
     "cross-worker reducers all-reduce whole gradients; use variables='replicated' (or a "
     "TowerTrainer in one process)"),
    ("variables=sharded", "all_reduce!=ring",
     "the sharded placement reduce-scatters with the ring's own phase and calls no other "
     "algorithm or wrapper (it would be silently skipped); leave all_reduce unset or use "
     "variables='replicated' with this all_reduce"),
    ("variables=sharded", "sparse=gather",
     "a shard owner updates a dense slice of every variable, so a sparse (Embedding) "
     "gradient cannot stay sparse; pass sparse='densify', or leave it unset"),
    ("variables=sharded", "optimizer=loss_scale",
     "a LossScaleOptimizer decides to skip a step from whole gradients, and each shard "
     "owner sees only its shard; use variables='replicated' (the same arithmetic)"),
    ("all_reduce=compressed compressed+state", "sparse=gather",
     "a codec reduces every gradient with one state per variable, so a sparse (Embedding) "
     "gradient cannot be gathered beside it; leave sparse unset or pass sparse='densify'"),
    ("trainer=WorkerTrainer", "jit_compile=on",
     "a worker's step under XLA (its empty towers run the model on no examples) is not yet "
     "checked; use jit_compile=False, or a TowerTrainer in one process"),
    ("trainer=WorkerTrainer", "loss_denominator=constant",
     "a worker divides by the global batch summed over workers; a constant of one "
     "worker's shards would weigh the workers' examples differently; leave "
     "loss_denominator unset or 'global'"),
    ("batch_norm=synchronized", "jit_compile=on",
     "the towers' statistics meet through TensorFlow's collective ops, which an XLA "
     "cluster does not run (measured on CPU: UnimplementedError); use jit_compile=False"),
    ("trainer=WorkerTrainer", "batch_norm=synchronized",
     "the statistics would meet over one worker's towers only; use synchronized=False, or "
     "a TowerTrainer in one process"),
    ("trainer=WorkerTrainer", "semantics=mirrored",
     "MirroredStrategy's per-replica divisor and first-tower state are a one-process "
     "comparison; use semantics='one_device' across workers (or a TowerTrainer in one "
     "process)"),
)
"""Every refused cell, one rule per reason."""

LIMITS = _rules(
    ("trainer=WorkerTrainer", "all_reduce!=cross-worker",
     "with num_workers=1 only: across workers a local reducer is refused, naming "
     "num_workers (each worker would train alone): use AllTowers (the default) or "
     "CrossWorker"),
    ("trainer=TowerTrainer", "all_reduce=cross-worker",
     "with op='mean' or one worker: op='sum' across workers is refused, naming op (each "
     "worker's loss is over its own batch, so the gradient would be multiplied by the "
     "worker count; WorkerTrainer divides by the global batch and sums)"),
    ("trainer=WorkerTrainer", "semantics=one_device",
     "across workers, floating non-trainable state (BatchNormalization) is refused, naming "
     "the variables: combined over one worker's towers only, the workers' copies would "
     "drift"),
    ("variables=sharded", "sparse=densify",
     "an Embedding with an optimizer whose sparse update (repeated rows) differs from its "
     "dense one (measured when the trainer is built: Adam, RMSprop, …; SGD and Lion agree) "
     "is refused, naming all three, unless sparse='densify' is passed explicitly (then it "
     "equals variables='replicated' with sparse='densify')"),
    ("trainer=WorkerTrainer", "sparse=gather densify",
     "across workers a sparse (Embedding) gradient is refused when the step is traced: the "
     "cross-worker reducers take dense gradients"),
)
"""Cells that work only under a condition the trainer checks (``✓n`` in the matrix)."""


def refusal_for(options: Mapping[str, str]) -> Rule | None:
    """The first refusal whose cells hold ``options``, or None when they compose."""
    return next((r for r in REFUSALS if r.matches(options)), None)


def check(options: Mapping[str, str], shown: Mapping[str, str] | None = None,
          algorithm: Any = None) -> None:
    """A ``ValueError`` naming both options of a refused cell (``shown``: axis -> the
    argument as the user wrote it), for a value not on its axis, or for a ``TowerTrainer``
    whose reducer (``algorithm``) sums over several workers."""
    for axis, value in options.items():
        if axis not in AXES or value not in AXES[axis]:
            raise ValueError(f"capabilities: {axis}={value!r} is not in the table {AXES.get(axis)}")
    refusal, shown = refusal_for(options), shown or {}
    if refusal is not None:
        first, second = (f"{a}={options[a]!r}" if shown.get(a) is None
                         else f"{a}={shown[a]} (a {options[a]!r} kind)"
                         for a in (refusal.first[0], refusal.second[0]))
        raise ValueError(f"{first} with {second} is refused: {refusal.text}")
    if options.get("trainer") == "TowerTrainer" and options.get("all_reduce") == "cross-worker":
        op, workers = getattr(algorithm, "op", "sum"), getattr(algorithm, "num_workers", 1)
        if op == "sum" and workers > 1:
            raise ValueError(
                f"all_reduce={algorithm!r} in a TowerTrainer: each worker's loss is over its "
                f"own batch, so summing over {workers} workers multiplies the gradient by "
                f"{workers}; use op='mean' (equal batches) or towers.cluster.WorkerTrainer")


def default_all_reduce(variables: str, all_reduce: Any) -> Any:
    """``all_reduce``, or when unset (None) the placement's: the ring for ``sharded``."""
    if all_reduce is not None:
        return all_reduce
    return "ring" if variables == "sharded" else "parameter_device"


def default_sparse(variables: str, kind: str, sparse: str | None) -> str:
    """``sparse``, or when unset: ``"densify"`` for ``sharded`` or a codec, else ``"gather"``."""
    if sparse is not None:
        return sparse
    return "densify" if variables == "sharded" or kind.startswith("compressed") else "gather"


def algorithm_kind(algorithm: Any) -> str:
    """The ``all_reduce`` axis value of a resolved algorithm or reducer (docs/options.md)."""
    if isinstance(algorithm, Compressed):
        state = algorithm.codec.init(tf.TensorShape([2]), tf.float32, 0)
        return "compressed+state" if tf.nest.flatten(state) else "compressed"
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


def _cell(column: dict[str, str], axis: str, value: str, notes: list[Rule]) -> str:
    """``—``, ``✓``, or ``✓n``/``✗n`` with ``n`` its rule's note number."""
    if axis not in OPTIONS_OF.get(column["trainer"], (axis,)):
        return "—"
    cell = {**column, axis: value}
    rule = refusal_for(cell) or next((m for m in LIMITS if m.matches(cell)), None)
    if rule is None:
        return "✓"
    if rule not in notes:
        notes.append(rule)
    return f"{'✗' if rule in REFUSALS else '✓'}{notes.index(rule) + 1}"


def markdown() -> str:
    """The table as a Markdown matrix (docs/options.md): a row per value, a column per trainer."""
    columns = [(p, {"trainer": "TowerTrainer", "variables": p}) for p in AXES["variables"]]
    columns += [(t, {"trainer": t}) for t in AXES["trainer"][1:]]
    notes: list[Rule] = []
    lines = ["| option | " + " | ".join(label for label, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]  # fmt: skip
    for axis in [a for a in AXES if a not in ("trainer", "variables")]:
        for value in AXES[axis]:
            cells = [_cell(column, axis, value, notes) for _, column in columns]
            lines.append(f"| `{axis}={value}` | " + " | ".join(cells) + " |")
    lines += ["", *(f"{k}. {rule.text}." for k, rule in enumerate(notes, 1))]
    for k, rule in enumerate([r for r in REFUSALS if r not in notes], len(notes) + 1):
        (a, va), (b, vb) = rule.first, rule.second
        scope = "" if "trainer" in (a, b) else " (any trainer)"
        lines.append(f"{k}. `{a}` ∈ {{{', '.join(va)}}} with `{b}` ∈ {{{', '.join(vb)}}}"
                     f"{scope}: {rule.text}.")
    return "\n".join(lines)


def sums_exactly(algorithm: Any, placement: str) -> bool:
    """Whether a NaN in any tower is one in every output (IEEE additions, no state): the
    library's own registry algorithms and ``sharded``'s ring."""
    if placement == "sharded":
        return True
    record = record_of(algorithm)
    module = str(getattr(record.algorithm.factory, "__module__", "") or "") if record else ""
    if record is None or algorithm_kind(algorithm) not in ("ring", "registered") \
            or not module.startswith("towers."):
        return False
    # a library algorithm built from parts (hierarchical's inner and outer) is exact
    # only when its parts are: a part may be a user's callable or registered name
    parts = [v for v in record.params.values() if callable(v)
             or (isinstance(v, str) and v in ALGORITHMS)]
    return all(sums_exactly(ALGORITHMS[p]() if isinstance(p, str) else p, placement)
               for p in parts)  # fmt: skip
