"""``bisect``: the first step, variable and element where two configurations part.

Two configurations (a towers trainer with algorithm A against one with algorithm B,
or a towers trainer against a ``tf.distribute`` reference from ``reference/``) train
on the same batches from the same weights. Run A is the teacher: before every step
run B is set to A's weights, so each step is checked on its own, as a one-step bound
(:mod:`towers.testing.onestep`)::

    step:      1        2        3        4   …
    A (free)   W1 ────▶ W2 ────▶ W3 ────▶ W4
               │set     │set     │set
    B          G1'      G2'      G3'  ✗       first step outside the bound
                                  │
                                  ├─ first variable in model order outside it
                                  └─ first element outside it: its chunk k of m
                                     (elements lo..hi) under B's pad_split into
                                     n·subchunks pieces, both values, |Δ|, bound

Because every step starts from the same weights, the steps are independent and an
in-order scan finds the first bad one exactly (a binary search over free-running
runs would find where trajectories part, which rounding alone makes happen).

Two towers trainers are compared on their reduced gradients (the step's public
phases ``split → forward_backward → reduce``, run eagerly). A ``tf.distribute``
reference exposes no gradient, so against one the comparison is the update of one
plain-SGD step from the same weights, held to :func:`towers.testing.sgd_step_bound`
with the tower gradients as the summed terms; any other optimizer is refused. A
towers side always runs its phases eagerly, so a stateful reduction (one that counts
its calls) is called once per variable per step, in model order, in both modes.

Example:
    >>> report = bisect("ring", "mirrored", batches, model_fn=make_model,
    ...                 optimizer_fn=lambda: keras.optimizers.SGD(0.1),
    ...                 loss="sparse_categorical_crossentropy")    # doctest: +SKIP
    >>> report.first                                               # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np

from towers.allreduce.machinery.registry import algorithm_name
from towers.devices import local_devices
from towers.step import TowerTrainer
from towers.testing.onestep import (
    Difference,
    algorithm_depth,
    compare_runs,
    plain_sgd_rate,
    step_gradients,
    take_batches,
    update_step,
)

__all__ = ["REFERENCES", "BisectReport", "Config", "Divergence", "bisect", "config"]

REFERENCES = ("mirrored", "central_storage")
"""The ``tf.distribute`` references a configuration may name."""


@dataclasses.dataclass(frozen=True)
class Config:
    """One side of a bisection.

    Attributes:
        all_reduce: the towers trainer's algorithm (name, callable or reducer), or
            ``"mirrored"`` / ``"central_storage"`` for a ``tf.distribute`` reference.
        variables: the towers trainer's placement.
        label: how the report names it (default: from ``all_reduce``).
    """

    all_reduce: Any = "ring"
    variables: str = "replicated"
    label: str = ""

    @property
    def reference(self) -> bool:
        """A ``tf.distribute`` reference rather than a towers trainer."""
        return isinstance(self.all_reduce, str) and self.all_reduce in REFERENCES

    @property
    def name(self) -> str:
        """The label, or a name made from ``all_reduce``."""
        spec = self.all_reduce
        if self.label or isinstance(spec, str):
            return self.label or spec
        return algorithm_name(spec) if hasattr(spec, "__name__") else type(spec).__name__


def config(spec: Any) -> Config:
    """A :class:`Config` from a Config, ``"towers:NAME"``, a name, a reference or a callable.

    Raises:
        ValueError: an empty name, or ``"towers:"`` naming a reference.
    """
    if isinstance(spec, Config):
        return spec
    if isinstance(spec, str):
        name = spec.removeprefix("towers:")
        if not name or (name != spec and name in REFERENCES):
            raise ValueError(f"config: expected an algorithm name after 'towers:', got {spec!r}")
        return Config(name)
    if callable(spec) or hasattr(spec, "reduce_gradients"):  # an algorithm or a reducer
        return Config(spec)
    raise ValueError(f"config must be a Config, a name, an all-reduce or a reducer, got {spec!r}")


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two runs first part: the step, the variable and the first element outside.

    Attributes:
        step: the step, counted from 1.
        variable: the variable's path; ``index`` its place in model order.
        element: the first flat index outside the bound.
        value_a, value_b: that element in both runs (gradients, or weights after the step).
        diff, bound: ``|value_a − value_b|`` and the bound there.
        chunk: ``(k, pieces, lo, hi)``: the element lies in chunk ``k`` of ``pieces``
            (flat elements ``lo..hi−1``) when B's algorithm splits the variable with
            ``pad_split`` into ``n·subchunks`` pieces (ring, halving-doubling, …).
        compared: ``"gradient"`` or ``"update"`` (one SGD step, against a reference).
        cause: gradients only: which part left its own bound (``"reduction (B)"``,
            ``"reduction (reference)"`` for A, or ``"kernels"``: the towers' inputs differ).
    """

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


@dataclasses.dataclass(frozen=True)
class BisectReport:
    """What :func:`bisect` found: ``first`` is None when every step stayed within bound."""

    a: str
    b: str
    towers: int
    rows: tuple[Difference, ...]
    first: Divergence | None

    @property
    def ok(self) -> bool:
        """No step left the bound."""
        return self.first is None

    def __str__(self) -> str:
        steps = max((r.step for r in self.rows), default=0)
        lines = [f"bisect {self.a} (A, teacher) vs {self.b} (B), {self.towers} towers, "
                 f"{steps} step(s) checked from the same weights"]  # fmt: skip
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
            f"  element {d.element} (chunk {k} of {pieces}: elements {lo}..{hi - 1})",
            f"  A = {d.value_a!r}  B = {d.value_b!r}  |Δ| = {d.diff:.3g} > bound {d.bound:.3g}",
        ]
        return "\n".join(lines)


def _trainer(side: Config, model_fn: Any, optimizer_fn: Any, loss: Any, devices: list[str]) -> Any:
    if side.reference:
        from reference import CentralStorageTrainer, MirroredTrainer

        cls = MirroredTrainer if side.all_reduce == "mirrored" else CentralStorageTrainer
        return cls(model_fn, optimizer_fn, loss, devices)

    return TowerTrainer(model_fn, optimizer_fn, loss, devices=devices,
                        all_reduce=side.all_reduce, variables=side.variables,
                        check_algorithm=False)  # fmt: skip  (bisect reports on it itself)


def _chunk(side: Config, trainer: Any, size: int, element: int) -> tuple[int, int, int, int]:
    """Where ``element`` falls when B's algorithm pad-splits the flat variable."""
    params = getattr(getattr(trainer, "algorithm", None), "params", {}) or {}
    pieces = len(trainer.devices) * int(params.get("subchunks", 1)) if not side.reference else 1
    length = max(1, -(-size // pieces))  # pad_split: ceil(size / pieces) elements each
    k = element // length
    return k, pieces, k * length, min(size, (k + 1) * length)


def _divergence(
    row: Difference, a: np.ndarray, b: np.ndarray, compared: str,
    chunk: Callable[[int, int], tuple[int, int, int, int]],
) -> Divergence:
    """The first element outside (``row.worst``: the first with an infinite ratio)."""
    k = row.worst
    values = float(a.ravel()[k]), float(b.ravel()[k])
    return Divergence(row.step, row.variable, row.index, k, *values, row.worst_diff, row.bound,
                      chunk(a.size, k), compared, row.cause)  # fmt: skip


def _gradient_step(a: Any, b: Any, x: Any, y: Any, label: str, step: int) -> tuple[Any, ...]:
    """Two towers trainers from A's weights: their reduced gradients, bounded and attributed."""
    b.set_weights(a.get_weights())
    runs = step_gradients(a, x, y), step_gradients(b, x, y)
    names = [v.path for v in a.model.trainable_variables]
    depths = algorithm_depth(a), algorithm_depth(b)
    rows = compare_runs(label, step, names, runs, depths, None)
    a.apply(runs[0].phases)
    return rows, runs[0].reduced, runs[1].reduced


def bisect(
    config_a: Any,
    config_b: Any,
    batches: Iterable[Any],
    *,
    model_fn: Callable[[], keras.Model],
    optimizer_fn: Callable[[], keras.optimizers.Optimizer],
    loss: Any,
    towers: int = 4,
    steps: int | None = None,
) -> BisectReport:
    """Find the first step, variable and element where configuration B leaves A's bound.

    Args:
        config_a: the teacher: a :class:`Config`, an algorithm name, ``"towers:NAME"``,
            ``"mirrored"``, ``"central_storage"`` or an all-reduce callable.
        config_b: the configuration under test, the same kinds.
        batches: ``(x, y)`` global batches.
        model_fn: a zero-argument factory of a built ``keras.Model``.
        optimizer_fn: a zero-argument factory of a Keras optimizer (plain SGD when a
            side is a reference).
        loss: a Keras loss, a loss name or ``(y_true, y_pred) -> per-example losses``.
        towers: the tower count of both runs.
        steps: how many batches to check at most (default: all).

    Returns:
        A :class:`BisectReport`; ``report.first`` is the :class:`Divergence` or None.

    Raises:
        ValueError: bad configurations, tower count, batches or steps; an optimizer
            other than plain SGD against a reference.
    """
    side_a, side_b = config(config_a), config(config_b)
    devices = local_devices()
    if isinstance(towers, bool) or not isinstance(towers, int) or not 1 <= towers <= len(devices):
        have = len(devices)
        raise ValueError(f"towers must be an integer in 1..{have} (devices), got {towers!r}")
    data = take_batches(batches, steps)
    a, b = (_trainer(s, model_fn, optimizer_fn, loss, devices[:towers]) for s in (side_a, side_b))
    b.set_weights(a.get_weights())
    lr = plain_sgd_rate(a.optimizer) if side_a.reference or side_b.reference else None
    compared = "gradient" if lr is None else "update"
    chunk = lambda size, k: _chunk(side_b, b, size, k)  # noqa: E731
    rows: list[Difference] = []
    for step, (x, y) in enumerate(data, start=1):
        if lr is None:
            found, want, got = _gradient_step(a, b, x, y, side_b.name, step)
        else:
            found, want, got = update_step((a, b), x, y, loss, lr, side_b.name, step)
        rows.extend(found)
        bad = next((r for r in found if not r.ok), None)
        if bad is not None:
            first = _divergence(bad, want[bad.index], got[bad.index], compared, chunk)
            return BisectReport(side_a.name, side_b.name, towers, tuple(rows), first)
    return BisectReport(side_a.name, side_b.name, towers, tuple(rows), None)
