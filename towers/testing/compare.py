"""``compare`` and ``bisect``: two steps, teacher-forced from the same weights, within a bound."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np

from towers.allreduce.machinery.registry import algorithm_name
from towers.devices import local_devices
from towers.step import TowerTrainer
from towers.testing.bounds import UpdateBound, resolve_bound
from towers.testing.report import BisectReport, Difference, Divergence, possible_causes
from towers.testing.steps import check_step, is_step, step_towers, take_batches, teacher_step

__all__ = ["REFERENCES", "Config", "assert_steps_match", "bisect", "compare", "config",
           "update_bound"]

REFERENCES = ("mirrored", "central_storage")
"""The ``tf.distribute`` references a configuration may name."""

_REDUCTION_BOUND = ("reduction bound: each run's all-reduce within γ_k·Σ|g_i| of the exact sum "
                    "of its towers' gradients, plus their measured difference "
                    "(towers.testing.steps)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    """One side of a comparison: ``all_reduce`` (a name, callable, reducer, or a reference in
    :data:`REFERENCES`), ``variables`` placement, and its ``label`` in the report."""

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
    """A :class:`Config` from a Config, ``"towers:NAME"``, a name, a reference or a callable
    (ValueError: an empty name, or ``"towers:"`` naming a reference)."""
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
                        check_algorithm=False)  # fmt: skip  (the comparison reports on it)


def _label(step: Any) -> str:
    algorithm = getattr(step, "algorithm", None)
    if isinstance(step, TowerTrainer) and algorithm is not None:
        return f"TowerTrainer({algorithm_name(algorithm)})"
    return str(getattr(step, "label", "") or type(step).__name__)


def _sides(a: Any, b: Any, build: dict[str, Any], towers: int | None) -> tuple[Any, ...]:
    """Both sides as steps (configurations built into trainers), their labels, towers."""
    if is_step(a) and is_step(b):
        n = towers or step_towers(a) or step_towers(b)
        return a, b, _label(a), _label(b), n
    devices = local_devices()
    n = 4 if towers is None else towers
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(devices):
        raise ValueError(f"towers must be an integer in 1..{len(devices)} (devices), got {n!r}")
    missing = [k for k, v in build.items() if v is None]
    if missing:
        raise ValueError(f"bisect: configurations (not steps) need {', '.join(missing)} to "
                         "build their trainers")  # fmt: skip
    configs = [s if is_step(s) else config(s) for s in (a, b)]
    steps = [c if is_step(c) else _trainer(c, **build, devices=devices[:n]) for c in configs]
    labels = [c.name if isinstance(c, Config) else _label(c) for c in configs]
    return steps[0], steps[1], labels[0], labels[1], n


def _divergence(row: Difference, want: np.ndarray, got: np.ndarray, a: Any, b: Any,
                compared: str, bound: str, sizes: list[int], towers: int) -> Divergence:
    """The first element outside (``row.worst``: the first with an infinite ratio) and the
    :func:`possible_causes` its batches and sides show."""
    k = row.worst
    values = float(want.ravel()[k]), float(got.ravel()[k])
    params = getattr(getattr(b, "algorithm", None), "params", {}) or {}
    towered = isinstance(b, TowerTrainer)  # where k falls when B's algorithm pad-splits:
    pieces = len(b.devices) * int(params.get("subchunks", 1)) if towered else 1
    span = max(1, -(-want.size // pieces))  # ceil(size / pieces) elements each
    c = k // span
    chunk = (c, pieces, c * span, min(want.size, (c + 1) * span))
    causes, setting = possible_causes(a, b, sizes, step=row.step, towers=towers,
                                      diff=row.worst_diff, value=max(map(abs, values)),
                                      dtype=want.dtype)  # fmt: skip
    return Divergence(row.step, row.variable, row.index, k, *values, row.worst_diff, row.bound,
                      chunk, compared, row.cause, bound, causes, setting)


def _run(a: Any, b: Any, batches: Iterable[Any], *, stop: bool, bound: Any, loss: Any,
         towers: int | None, steps: int | None, model_fn: Any, optimizer_fn: Any,
         ) -> BisectReport:  # fmt: skip
    build = {"model_fn": model_fn, "optimizer_fn": optimizer_fn, "loss": loss}
    configs = not (is_step(a) and is_step(b))
    a, b, label_a, label_b, n = _sides(a, b, build, towers)
    check_step("a", a), check_step("b", b)
    data = take_batches(batches, steps)
    if configs:
        b.set_weights(a.get_weights())
    gradients = bound is None and isinstance(a, TowerTrainer) and isinstance(b, TowerTrainer)
    update = None if gradients else update_bound(a, b, bound, loss, configs)
    name = _REDUCTION_BOUND if update is None else update.name
    rows: list[Difference] = []
    first = None
    for step, (x, y) in enumerate(data, start=1):
        found, want, got = teacher_step(a, [b], x, y, update, [label_b], step)[0]
        rows.extend(found)
        bad = next((r for r in found if not r.ok), None)
        if bad is not None and first is None:
            compared = "gradient" if update is None else "update"
            first = _divergence(bad, want[bad.index], got[bad.index], a, b, compared, name,
                                [len(x) for x, _ in data], n or 1)  # fmt: skip
            if stop:
                break
    return BisectReport(label_a, label_b, n or 0, tuple(rows), first, name,
                        "bisect" if stop else "compare")  # fmt: skip


def update_bound(a: Any, b: Any, bound: Any, loss: Any, configs: bool = False) -> UpdateBound:
    """The bound of an update comparison, sized from the teacher (:func:`resolve_bound`)."""
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
        a, b: the teacher and the step under test: each a step or a configuration (an
            algorithm name, ``"towers:NAME"``, ``"mirrored"``, ``"central_storage"``, an
            all-reduce callable, a :class:`Config`); ``batches``: ``(x, y)`` global batches.
        bound: None (derived), a tolerance, or ``(weights, x, y) -> [tolerance per weight]``.
        loss: the loss (configurations, or a derived bound for steps without ``loss_fn``).
        towers: the tower count (configurations: default 4; steps: from their devices).
        steps, model_fn, optimizer_fn: at most that many batches (default: all); zero-argument
            factories (configurations only).

    Raises:
        TypeError: a side that is neither a step nor a configuration.
        ValueError: bad batches, steps or towers; no bound for the optimizer (pass
            ``bound=``); configurations without model_fn, optimizer_fn or loss.
    """
    return _run(a, b, batches, stop=False, bound=bound, loss=loss, towers=towers,
                steps=steps, model_fn=model_fn, optimizer_fn=optimizer_fn)  # fmt: skip


def bisect(
    config_a: Any, config_b: Any, batches: Iterable[Any], *,
    model_fn: Callable[[], keras.Model] | None = None,
    optimizer_fn: Callable[[], keras.optimizers.Optimizer] | None = None,
    loss: Any = None, towers: int | None = None, steps: int | None = None, bound: Any = None,
) -> BisectReport:
    """:func:`compare` that stops at the first step, variable and element where B leaves
    A's bound: ``report.ok``, ``report.step``, ``report.variable``, ``report.first``."""
    return _run(config_a, config_b, batches, stop=True, bound=bound, loss=loss, towers=towers,
                steps=steps, model_fn=model_fn, optimizer_fn=optimizer_fn)  # fmt: skip


def assert_steps_match(a: Any, b: Any, batches: Iterable[Any], **options: Any) -> BisectReport:
    """Assert step ``b`` matches the teacher ``a`` on every batch (:func:`compare`'s
    ``options``); returns the report, else raises AssertionError with it as the message."""
    report = compare(a, b, batches, **options)
    if not report.ok:
        raise AssertionError(f"the steps differ\n{report}")
    return report
