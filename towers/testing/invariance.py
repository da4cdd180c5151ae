"""``check_invariance``: does training give the same result on 1, 2, 4, 8 towers?"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import keras
import numpy as np

from towers.devices import local_devices
from towers.split import shard_sizes
from towers.step import TowerTrainer
from towers.testing.bounds import exact_sums
from towers.testing.compare import update_bound
from towers.testing.report import Difference
from towers.testing.steps import advance, take_batches, teacher_step
from towers.testing.strategies import per_tower_gradients

__all__ = ["InvarianceReport", "check_invariance"]


@dataclasses.dataclass(frozen=True)
class InvarianceReport:
    """One :class:`Difference` per (tower count, step, variable) against the first count, and
    the free-running ``trajectory`` ``{towers: [max |ΔW| after each step]}`` (not judged)."""

    towers: tuple[int, ...]
    rows: tuple[Difference, ...]
    trajectory: dict[int, list[float]]

    @property
    def ok(self) -> bool:
        """Every one-step difference lies within its bound."""
        return all(r.ok for r in self.rows)

    def _first(self, bad: Sequence[Difference]) -> Difference | None:
        return min(bad, key=lambda r: (r.step, self.towers.index(int(r.towers)), r.index),
                   default=None)  # fmt: skip

    @property
    def first_failure(self) -> Difference | None:
        """The first (step, towers, variable) outside the bound, or None."""
        return self._first([r for r in self.rows if not r.ok])

    @property
    def reduction_ok(self) -> bool:
        """No difference outside the bound is the all-reduce's (kernels aside)."""
        return all(r.ok or r.cause == "kernels" for r in self.rows)

    def max_diff(self, towers: int) -> float:
        """The largest one-step gradient difference seen at ``towers`` towers."""
        return max((r.max_diff for r in self.rows if r.towers == towers), default=0.0)

    def __str__(self) -> str:
        head = (f"{'towers':>6}  {'step':>4}  {'max |ΔG|':>10}  {'worst |ΔG|':>10}  "
                f"{'its bound':>10}  {'free |ΔW|':>10}  verdict")  # fmt: skip
        lines = [f"invariance against {self.towers[0]} tower(s), one step from the same "
                 "weights (teacher forcing)", head]  # fmt: skip
        for n in self.towers[1:]:
            for step in sorted({r.step for r in self.rows if r.towers == n}):
                rows = [r for r in self.rows if r.towers == n and r.step == step]
                top = max(r.max_diff for r in rows)
                worst = max(rows, key=lambda r: r.worst_diff / r.bound if r.bound else np.inf)
                traj = self.trajectory.get(n, [])
                free = f"{traj[step - 1]:.3g}" if len(traj) >= step else "-"
                causes = sorted({r.cause for r in rows if not r.ok})
                verdict = "ok" if not causes else "OUTSIDE: " + ", ".join(causes)
                lines.append(f"{n:>6}  {step:>4}  {top:>10.3g}  {worst.worst_diff:>10.3g}  "
                             f"{worst.bound:>10.3g}  {free:>10}  {verdict}")  # fmt: skip
        # the verdict (and the CLI's exit code) is about the all-reduce before kernel noise
        bad = self._first([r for r in self.rows if not r.ok and r.cause != "kernels"])
        bad = bad or self.first_failure
        lines.append("PASS: every step within its bound" if bad is None else
                     f"FAIL: {bad.towers} towers, step {bad.step}, {bad.variable}: element "
                     f"{bad.worst} differs by {bad.worst_diff:.3g} > bound {bad.bound:.3g} "
                     f"({bad.cause})")
        if any(r.cause == "kernels" for r in self.rows):
            lines.append("note: 'kernels': the towers' own kernels computed an example differently "
                         "at this shard size (a MatMul blocks by batch size); the all-reduce "
                         "stayed within its bound. TF_ENABLE_ONEDNN_OPTS=0 holds the kernels to "
                         "the bound on some CPUs, not on all.")  # fmt: skip
        return "\n".join(lines)


def _check_towers(towers: Sequence[int], have: int) -> tuple[int, ...]:
    if isinstance(towers, (str, bytes)) or not isinstance(towers, Sequence) or not towers:
        raise ValueError(f"towers must be a non-empty sequence of tower counts, got {towers!r}")
    for n in towers:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= have:
            raise ValueError(f"towers must hold integers in 1..{have} (devices), got {n!r}")
    if len(set(towers)) != len(towers):
        raise ValueError(f"towers must not repeat a count, got {list(towers)}")
    return tuple(towers)


def check_invariance(
    model_fn: Callable[[], keras.Model], optimizer_fn: Callable[[], keras.optimizers.Optimizer],
    loss: Any, batches: Iterable[Any], *, towers: Sequence[int] = (1, 2, 4, 8),
    all_reduce: Any = "ring", variables: str = "replicated", steps: int | None = None,
    trajectory: bool = True, step: Callable[..., Any] | None = None, bound: Any = None,
) -> InvarianceReport:
    """Train one trainer per tower count on the same batches; compare each step with the first.

    Args:
        model_fn, optimizer_fn: zero-argument factories of a built model and an optimizer.
        loss: a Keras loss, a loss name or ``(y_true, y_pred) -> per-example losses``.
        batches, steps: ``(x, y)`` global batches, at most ``steps`` of them (default: all).
        towers, all_reduce, variables: the tower counts (the first is the reference), every
            trainer's algorithm and placement.
        trajectory: also train every count freely and report its weight difference.
        step: a step factory ``(model_fn, optimizer_fn, loss, devices) -> step`` to check
            instead of a ``TowerTrainer`` (``all_reduce``/``variables`` unused).
        bound: a ``step``'s bound: None (derived), a tolerance or a callable.

    Raises:
        ValueError: a tower count outside ``1..len(local devices)`` or repeated, bad batches.
    """
    devices = local_devices()
    counts = _check_towers(towers, len(devices))
    data = take_batches(batches, steps)
    trainers = step is None
    factory = step or (lambda model, opt, lossfn, devs: TowerTrainer(
        model, opt, lossfn, devices=devs, all_reduce=all_reduce, variables=variables,
        check_algorithm=False))  # this check reports on the algorithm instead
    made = {n: factory(model_fn, optimizer_fn, loss, devices[:n]) for n in counts}
    ref, others = made[counts[0]], [made[n] for n in counts[1:]]
    start = ref.get_weights()
    for other in others:
        other.set_weights(start)
    limit = None if trainers else update_bound(ref, ref, bound, loss)
    rows: list[Difference] = []
    path = []
    for number, (x, y) in enumerate(data, start=1):
        kernels = partial(_kernels, ref, loss, x, y, counts) if trainers else None
        for found, _, _ in teacher_step(ref, others, x, y, limit, counts[1:], number, kernels):
            rows.extend(found)
        path.append(ref.get_weights())
    free = _free_run(made, counts, data, start, path) if trajectory and trainers else {}
    return InvarianceReport(counts, tuple(rows), free)


def _kernels(ref: Any, loss: Any, x: Any, y: Any, counts: tuple[int, ...]) -> list[Any]:
    """Per other count, the kernel part's bound: two trees over the per-example gradients,
    each within its :func:`exact_sums` bound; a leaf inside a tower is rounded by ``largest
    shard − 1`` additions and one product (depth: the largest shard)."""
    leaves = per_tower_gradients(ref.model, x, y, [ref.devices[0]] * len(x), loss=loss)
    tol = {n: exact_sums(leaves, max(shard_sizes(len(x), n)))[1] for n in counts}
    return [[a + b for a, b in zip(tol[counts[0]], tol[n], strict=True)] for n in counts[1:]]


def _free_run(trainers: dict[int, Any], counts: tuple[int, ...], data: list[Any],
              start: list[np.ndarray], path: list[list[np.ndarray]]) -> dict[int, list[float]]:
    """Each other tower count trained freely (its optimizer is still fresh) against ``path``."""
    out: dict[int, list[float]] = {}
    for n in counts[1:]:
        trainers[n].set_weights(start)
        out[n] = []
        for (x, y), want in zip(data, path, strict=True):
            diffs = [np.max(np.abs(a.astype(np.float64) - b), initial=0.0)
                     for a, b in zip(advance(trainers[n], x, y), want, strict=True)]  # fmt: skip
            out[n].append(float(max(diffs, default=0.0)))
    return out
