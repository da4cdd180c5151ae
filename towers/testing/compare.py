"""``compare``: two steps, teacher-forced from the same weights, held to a named bound.

Any two steps (:mod:`towers.testing.steps`: a ``TowerTrainer``, a ``tf.distribute``
reference, a user's step through ``as_step``) — or today's configurations (an
algorithm name, ``"mirrored"``, a :class:`Config`), built into trainers here — train
on the same batches. A is the teacher: before every step B is set to A's weights, so
each step is judged on its own (see :mod:`towers.testing.bisect` for the drawing)::

    both TowerTrainers   reduced gradients (split → forward_backward → reduce, eagerly)
                         within each run's reduction bound + the measured kernel part,
                         a difference attributed to "reduction (B)" / "kernels"
                         (towers.testing.onestep)
    anything else        the weights after one update, within the bound that
                         towers.testing.bounds.update picks (plain SGD: sgd_step_bound;
                         bound= a tolerance or a callable; an optimizer's tracked bound)

``compare`` checks every step; ``bisect`` stops at the first that leaves the bound.
Both return a :class:`~towers.testing.report.BisectReport` naming the bound used and
the causes of a divergence its batches and sides show (:mod:`towers.testing.causes`).

Example:
    >>> report = compare(my_step, reference_step, batches)        # doctest: +SKIP
    >>> report.ok, report.first                                    # doctest: +SKIP
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
from towers.testing.bounds.update import UpdateBound, resolve_bound
from towers.testing.causes import explained
from towers.testing.onestep import (
    Difference,
    algorithm_depth,
    compare_gradients,
    compare_runs,
    step_gradients,
    take_batches,
)
from towers.testing.report import BisectReport, Divergence
from towers.testing.steps import check_step, step_towers

__all__ = ["REFERENCES", "Config", "advance", "compare", "config", "run_comparison",
           "update_bound", "update_rows"]

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


def _trainer(side: Config, model_fn: Any, optimizer_fn: Any, loss: Any, devices: list[str]) -> Any:
    if side.reference:
        from reference import CentralStorageTrainer, MirroredTrainer

        cls = MirroredTrainer if side.all_reduce == "mirrored" else CentralStorageTrainer
        return cls(model_fn, optimizer_fn, loss, devices)

    return TowerTrainer(model_fn, optimizer_fn, loss, devices=devices,
                        all_reduce=side.all_reduce, variables=side.variables,
                        check_algorithm=False)  # fmt: skip  (bisect reports on it itself)


def _chunk(trainer: Any, size: int, element: int) -> tuple[int, int, int, int]:
    """Where ``element`` falls when B's algorithm pad-splits the flat variable."""
    params = getattr(getattr(trainer, "algorithm", None), "params", {}) or {}
    towered = isinstance(trainer, TowerTrainer)
    pieces = len(trainer.devices) * int(params.get("subchunks", 1)) if towered else 1
    length = max(1, -(-size // pieces))  # pad_split: ceil(size / pieces) elements each
    k = element // length
    return k, pieces, k * length, min(size, (k + 1) * length)


def _divergence(
    row: Difference, a: np.ndarray, b: np.ndarray, compared: str, trainer_b: Any, bound: str,
) -> Divergence:
    """The first element outside (``row.worst``: the first with an infinite ratio)."""
    k = row.worst
    values = float(a.ravel()[k]), float(b.ravel()[k])
    return Divergence(row.step, row.variable, row.index, k, *values, row.worst_diff, row.bound,
                      _chunk(trainer_b, a.size, k), compared, row.cause, bound)  # fmt: skip


def _gradient_step(a: Any, b: Any, x: Any, y: Any, label: str, step: int) -> tuple[Any, ...]:
    """Two towers trainers from A's weights: their reduced gradients, bounded and attributed."""
    b.set_weights(a.get_weights())
    runs = step_gradients(a, x, y), step_gradients(b, x, y)
    names = [v.path for v in a.model.trainable_variables]
    depths = algorithm_depth(a), algorithm_depth(b)
    rows = compare_runs(label, step, names, runs, depths, None)
    a.apply(runs[0].phases)
    return rows, runs[0].reduced, runs[1].reduced


def _update_step(
    a: Any, b: Any, x: Any, y: Any, bound: UpdateBound, label: int | str, step: int
) -> tuple[list[Difference], list[np.ndarray], list[np.ndarray]]:
    """Both steps from A's weights, one update each; the weights bound compares, held to it."""
    weights = a.get_weights()
    tol = bound.tolerances(weights, x, y)  # sized at the weights both start from
    after_a = advance(a, x, y)
    return update_rows(a, after_a, [b], weights, tol, x, y, label, step)[0]


def advance(step: Any, x: Any, y: Any) -> list[np.ndarray]:
    """One update of ``step`` (a towers trainer through its phases eagerly: a stateful
    reduction is called once per variable, as in the gradient comparison); its weights."""
    if isinstance(step, TowerTrainer):
        step.apply(step_gradients(step, x, y).phases)
    else:
        step.train_step(x, y)
    return step.get_weights()


def update_rows(
    a: Any, after_a: list[np.ndarray], others: list[Any], weights: list[np.ndarray],
    tol: list[Any], x: Any, y: Any, label: int | str, step: int,
) -> list[tuple[list[Difference], list[np.ndarray], list[np.ndarray]]]:
    """Each of ``others`` set to ``weights`` and advanced once, against A's ``after_a``.

    Returns:
        Per other step: (one :class:`Difference` per compared weight, A's and its weights).
    """
    keep = [i for i, t in enumerate(tol) if t is not None]
    model = getattr(a, "model", None)
    names = [model.weights[i].path if model is not None else f"weights[{i}]" for i in keep]
    want = [after_a[i] for i in keep]
    out = []
    for b in others:
        b.set_weights(weights)
        after_b = advance(b, x, y)
        got = [after_b[i] for i in keep]
        out.append((compare_gradients(label, step, names, got, want, [tol[i] for i in keep]),
                    want, got))  # fmt: skip
    return out


def _label(step: Any) -> str:
    algorithm = getattr(step, "algorithm", None)
    if isinstance(step, TowerTrainer) and algorithm is not None:
        return f"TowerTrainer({algorithm_name(algorithm)})"
    return str(getattr(step, "label", "") or type(step).__name__)


def _is_step(value: Any) -> bool:
    return all(callable(getattr(value, m, None)) for m in ("train_step", "get_weights",
                                                           "set_weights"))


def _towers(value: Any, have: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= have:
        raise ValueError(f"towers must be an integer in 1..{have} (devices), got {value!r}")
    return value


def _sides(a: Any, b: Any, build: dict[str, Any], towers: int | None) -> tuple[Any, ...]:
    """Both sides as steps (configurations built into trainers), their labels, towers."""
    if _is_step(a) and _is_step(b):
        n = towers or step_towers(a) or step_towers(b)
        return a, b, _label(a), _label(b), n
    devices = local_devices()
    n = _towers(4 if towers is None else towers, len(devices))
    missing = [k for k, v in build.items() if v is None]
    if missing:
        raise ValueError(f"bisect: configurations (not steps) need {', '.join(missing)} to "
                         "build their trainers")  # fmt: skip
    configs = [config(s) if not _is_step(s) else s for s in (a, b)]
    steps = [c if _is_step(c) else _trainer(c, **build, devices=devices[:n]) for c in configs]
    labels = [c.name if isinstance(c, Config) else _label(c) for c in configs]
    return steps[0], steps[1], labels[0], labels[1], n


def run_comparison(
    a: Any, b: Any, batches: Iterable[Any], *, stop: bool, bound: Any = None,
    loss: Any = None, towers: int | None = None, steps: int | None = None,
    model_fn: Callable[[], keras.Model] | None = None,
    optimizer_fn: Callable[[], keras.optimizers.Optimizer] | None = None,
) -> BisectReport:
    """:func:`compare` (``stop=False``) and ``bisect`` (``stop=True``): see :func:`compare`."""
    build = {"model_fn": model_fn, "optimizer_fn": optimizer_fn, "loss": loss}
    configs = not (_is_step(a) and _is_step(b))
    a, b, label_a, label_b, n = _sides(a, b, build, towers)
    check_step("a", a), check_step("b", b)
    data = take_batches(batches, steps)
    if configs:
        b.set_weights(a.get_weights())
    gradients = bound is None and isinstance(a, TowerTrainer) and isinstance(b, TowerTrainer)
    update = None if gradients else update_bound(a, b, bound, loss, configs)
    name = update.name if update is not None else (
        "reduction bound: each run's all-reduce within γ_k·Σ|g_i| of the exact sum of its "
        "towers' gradients, plus their measured difference (towers.testing.onestep)")
    rows: list[Difference] = []
    first = None
    for step, (x, y) in enumerate(data, start=1):
        if update is None:
            found, want, got = _gradient_step(a, b, x, y, label_b, step)
        else:
            found, want, got = _update_step(a, b, x, y, update, label_b, step)
        rows.extend(found)
        bad = next((r for r in found if not r.ok), None)
        if bad is not None and first is None:
            compared = "gradient" if update is None else "update"
            first = _divergence(bad, want[bad.index], got[bad.index], compared, b, name)
            first = explained(first, a, b, [len(x) for x, _ in data], n or 1,
                              want[bad.index].dtype)  # fmt: skip
            if stop:
                break
    kind = "bisect" if stop else "compare"
    return BisectReport(label_a, label_b, n or 0, tuple(rows), first, name, kind)


def update_bound(a: Any, b: Any, bound: Any, loss: Any, configs: bool = False) -> UpdateBound:
    """The bound of an update comparison (towers.testing.bounds.update), from the teacher."""
    optimizer = getattr(a, "optimizer", None) or getattr(b, "optimizer", None)
    model = getattr(a, "model", None) or getattr(b, "model", None)
    loss = loss if loss is not None else getattr(a, "loss_fn", None) or getattr(b, "loss_fn", None)
    return resolve_bound(bound, optimizer, model, loss,
                         argument="optimizer_fn" if configs else "bound")  # fmt: skip


def compare(
    a: Any, b: Any, batches: Iterable[Any], *, bound: Any = None, loss: Any = None,
    towers: int | None = None, steps: int | None = None,
    model_fn: Callable[[], keras.Model] | None = None,
    optimizer_fn: Callable[[], keras.optimizers.Optimizer] | None = None,
) -> BisectReport:
    """Compare two steps on every batch, teacher-forced from A's weights.

    Args:
        a: the teacher: a step (``train_step``/``get_weights``/``set_weights``) or a
            configuration (an algorithm name, ``"towers:NAME"``, ``"mirrored"``,
            ``"central_storage"``, an all-reduce callable, a :class:`Config`).
        b: the step under test, the same kinds.
        batches: ``(x, y)`` global batches.
        bound: None (derived: see the module docstring), a tolerance, or
            ``(weights, x, y) -> [tolerance per weight]``.
        loss: the loss (configurations; sizing a derived bound when the steps do not
            carry ``loss_fn``).
        towers: the tower count (configurations: default 4; steps: from their devices).
        steps: how many batches at most (default: all).
        model_fn, optimizer_fn: zero-argument factories (configurations only).

    Returns:
        A :class:`~towers.testing.report.BisectReport`: every step's rows, the first
        divergence (step, variable, element, both values, |Δ|, bound) and the bound's name.

    Raises:
        TypeError: a side that is neither a step nor a configuration.
        ValueError: bad batches, steps or towers; no bound for the optimizer (pass
            ``bound=``); configurations without model_fn, optimizer_fn or loss.
    """
    return run_comparison(a, b, batches, stop=False, bound=bound, loss=loss, towers=towers,
                          steps=steps, model_fn=model_fn, optimizer_fn=optimizer_fn)  # fmt: skip
