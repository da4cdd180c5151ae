"""What a comparison of two steps found, and the causes its batches and sides show."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import numpy as np

from towers.split import shard_sizes
from towers.step import TowerTrainer

__all__ = ["CLIPPING", "MIRRORED_SETTING", "ORDER_ULPS", "BisectReport", "Difference",
           "Divergence", "Side", "possible_causes"]


@dataclasses.dataclass(frozen=True)
class Difference:
    """One variable's largest difference at one step, and its bound: ``towers`` the run's
    tower count (or a label), ``worst`` the flat index of the largest ``diff / bound``,
    ``cause`` (not ``ok``) the part that left its bound, ``"reduction (…)"`` or ``"kernels"``."""

    towers: int | str
    step: int
    variable: str
    index: int
    max_diff: float
    worst: int
    worst_diff: float
    bound: float
    ok: bool
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two runs first part: ``element`` the first flat index outside, in chunk ``k``
    (elements ``lo..hi−1``) of B's pad-split ``chunk = (k, pieces, lo, hi)``; ``causes``:
    ``"name: why"`` per cause the batches and sides show; ``setting``: the one that
    reproduces MirroredStrategy's semantics, or ""."""

    step: int
    variable: str
    index: int
    element: int
    value_a: float
    value_b: float
    diff: float
    bound: float
    chunk: tuple[int, int, int, int]
    compared: str
    cause: str = ""
    bound_name: str = ""
    causes: tuple[str, ...] = ()
    setting: str = ""


@dataclasses.dataclass(frozen=True)
class BisectReport:
    """What ``compare`` or ``bisect`` (``kind``) found: ``first`` is None when every step
    stayed within ``bound``, which says which bound was used and why."""

    a: str
    b: str
    towers: int
    rows: tuple[Difference, ...]
    first: Divergence | None
    bound: str = ""
    kind: str = "bisect"

    @property
    def ok(self) -> bool:
        """No step left the bound."""
        return self.first is None

    @property
    def step(self) -> int | None:
        """The first divergence's step (from 1), or None."""
        return None if self.first is None else self.first.step

    @property
    def variable(self) -> str | None:
        """The first divergence's variable path, or None."""
        return None if self.first is None else self.first.variable

    def __str__(self) -> str:
        steps = max((r.step for r in self.rows), default=0)
        lines = [f"{self.kind} {self.a} (A, teacher) vs {self.b} (B), {self.towers} towers, "
                 f"{steps} step(s) checked from the same weights"]  # fmt: skip
        if self.bound:
            lines.append(f"bound: {self.bound}")
        for step in range(1, steps + 1):
            rows = [r for r in self.rows if r.step == step]
            verdict = "ok" if all(r.ok for r in rows) else "OUTSIDE"
            lines.append(f"  step {step}: max |Δ| {max(r.max_diff for r in rows):.3g}  {verdict}")
        d = self.first
        if d is None:
            lines.append("PASS: no step left the bound")
            return "\n".join(lines)
        k, pieces, lo, hi = d.chunk
        lines += [
            f"FIRST DIVERGENCE: step {d.step}, variable {d.variable} (#{d.index}, {d.compared}"
            + (f"; {d.cause})" if d.cause else ")"),
            f"  element {d.element}" + (f" (chunk {k} of {pieces}: elements {lo}..{hi - 1})"
                                        if pieces > 1 else ""),
            f"  A = {d.value_a!r}  B = {d.value_b!r}  |Δ| = {d.diff:.3g} > bound {d.bound:.3g}",
        ]
        if d.bound_name:
            lines.append(f"  bound used: {d.bound_name}")
        if d.causes or d.setting:  # wrapped to the report's width
            lines.append("  possible causes, read from the batches and both sides "
                         "(towers.testing.report):")
        for cause in d.causes:
            lines += textwrap.wrap(cause, 96, initial_indent="    - ", subsequent_indent="      ")
        if d.setting:
            lines += textwrap.wrap(d.setting, 96, initial_indent="  the setting: ",
                                   subsequent_indent="    ")  # fmt: skip
        return "\n".join(lines)


ORDER_ULPS = 8  # a difference another summation order makes, in ULPs of the value
CLIPPING = ("clipnorm", "global_clipnorm", "clipvalue")
MIRRORED_SETTING = (
    'TowerTrainer(..., semantics="mirrored") (or TowerModel) reproduces MirroredStrategy\'s '
    "semantics: each replica divides its loss by its shard × replicas, and the first "
    "tower's non-trainable state is kept")


def possible_causes(a: Any, b: Any, sizes: Sequence[int], *, step: int, towers: int, diff: float,
                    value: float, dtype: Any) -> tuple[tuple[str, ...], str]:
    """``(causes, setting)``: one ``"name: why"`` per cause of a divergence at ``step`` that
    the batch ``sizes`` and the two sides show, and :data:`MIRRORED_SETTING` when it applies
    (else ""); ``diff``, ``value``, ``dtype``: the first element outside (|Δ|, its larger
    value, its dtype: for the ULPs)."""
    sides = (_side(a), _side(b))
    found = [_uneven(sides, sizes, step, towers), _clipping(a, b, sides),
             _batch_norm(a, b, sides), _order(diff, value, dtype)]  # fmt: skip
    ours = [s for s in sides if s.towers]
    mirrored = (found[0] and not all(s.divisor == "per_replica" for s in ours)) or (
        found[2] and not all(s.first_tower for s in ours))
    beside = bool(ours) and any(s.replicated for s in sides)  # towers beside a strategy
    return tuple(line for line in found if line), MIRRORED_SETTING if mirrored and beside else ""


class Side(NamedTuple):
    """How a step computes: its loss ``divisor`` (None: undeclared), whether it keeps the
    ``first_tower``'s state, ``towers`` (0: not a towers trainer), under several replicas."""

    divisor: Any
    first_tower: bool | None
    towers: int
    replicated: bool


def _side(step: Any) -> Side:
    if isinstance(step, TowerTrainer):
        return Side(step.options.divisor, step.options.semantics == "mirrored",
                    len(step.devices), False)  # fmt: skip
    strategy = getattr(step, "strategy", None)
    replicas = 1 if strategy is None else int(strategy.num_replicas_in_sync)
    return Side(getattr(step, "loss_denominator", None), None, 0, replicas > 1)


def _divisor(side: Side, shards: list[int], towers: int) -> str:
    """What ``side`` divides each tower's loss sum by, in words."""
    per_replica = ", ".join(str(s * towers) for s in shards if s)
    if side.divisor == "global":
        return f"{sum(shards)} (the global batch)"
    if side.divisor == "per_replica":
        return f"{per_replica} (shard × replicas)"
    if isinstance(side.divisor, (int, float)) and not isinstance(side.divisor, bool):
        return f"{side.divisor:g} (a constant)"
    return (f"what it does not declare (tf.nn.compute_average_loss without global_batch_size: "
            f"shard × replicas, {per_replica}; or a fixed global batch size)")  # fmt: skip


def _uneven(sides: tuple[Side, Side], sizes: Sequence[int], step: int, towers: int) -> str:
    batch = int(sizes[step - 1])
    shards = shard_sizes(batch, towers)
    split, short = batch % towers != 0, batch < max(sizes)
    a, b = sides
    if not (split or short) or (a.divisor is not None and a.divisor == b.divisor):
        return ""
    shape = [f"splits {'+'.join(map(str, shards))} over {towers} towers"] if split else []
    shape += [f"is shorter than the largest batch ({max(sizes)})"] if short else []
    return (f"uneven batch: step {step}'s batch of {batch} {' and '.join(shape)}, and the "
            f"sides' loss divisors may differ (A divides each tower's loss sum by "
            f"{_divisor(a, shards, towers)}; B by {_divisor(b, shards, towers)}): its "
            "examples weigh differently")  # fmt: skip


def _clipping(a: Any, b: Any, sides: tuple[Side, Side]) -> str:
    clips = [tuple((k, getattr(o, k)) for k in CLIPPING if getattr(o, k, None) is not None)
             for o in (getattr(a, "optimizer", None), getattr(b, "optimizer", None))]
    if not any(clips) or (clips[0] == clips[1] and not any(s.replicated for s in sides)):
        return ""
    said = "; ".join(f"{label}'s optimizer has " + ", ".join(f"{k}={v:g}" for k, v in c)
                     for label, c in zip("AB", clips) if c)  # fmt: skip
    return (f"gradient clipping: {said}. Keras 3 under MirroredStrategy clips each replica's "
            "share before the all-reduce (the result depends on the replica count); a "
            "TowerTrainer, like one device, clips the summed gradient; no derived bound covers "
            "clipping: compare without it to check the rest")  # fmt: skip


def _batch_norm(a: Any, b: Any, sides: tuple[Side, Side]) -> str:
    names, todo = set(), [getattr(step, "model", None) for step in (a, b)]
    while todo:  # both models' layers, nested ones too
        layer = todo.pop()
        todo.extend(getattr(layer, "layers", []))
        if isinstance(layer, keras.layers.BatchNormalization):
            names.add(layer.name)
    alike = sides[0].towers and sides[0][1:3] == sides[1][1:3]  # towers trainers, alike
    if not names or alike:
        return ""
    return (f"BatchNormalization ({', '.join(sorted(names))}): each replica normalizes its "
            "own shard (one device: the whole batch), and under MirroredStrategy each replica "
            "updates its own moving statistics (replica 0's are read); towers averages them "
            "across towers unless non_trainable=\"first_tower\"")  # fmt: skip


def _order(diff: float, value: float, dtype: Any) -> str:
    kind = np.dtype(dtype) if np.dtype(dtype).kind == "f" else np.dtype("float32")
    spacing = float(np.spacing(np.abs(np.asarray(value, kind))))
    if not spacing or diff > ORDER_ULPS * spacing:
        return ""
    return (f"reduction order: |Δ| is {diff / spacing:.3g} ULP of the value, what adding the "
            "same gradients in another order makes (another all-reduce, the reference's "
            "collective order, Grappler's AddN sort); a bound that tight cannot hold two "
            "correct steps")  # fmt: skip
