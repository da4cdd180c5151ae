"""A step, and one teacher-forced step of two or more of them: what every comparison drives.

Two runs' reduced gradients differ by at most three bounded parts (the triangle inequality):
each run's reduction within ``γ_k·Σ|g_i|`` of its towers' exact sum, and the kernels (at
equal tower counts measured; across counts a tree of depth ``largest shard`` over the
per-example gradients). A difference outside is blamed on the part that left its own bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf

from towers.guard.arguments import optional, positive_int
from towers.step import TowerTrainer
from towers.testing.bounds import exact_sums, summation_depth
from towers.testing.report import Difference

__all__ = ["AdaptedStep", "Step", "StepGradients", "advance", "as_step", "check_step",
           "compare_gradients", "compare_runs", "is_step",
           "step_gradients", "step_towers", "take_batches", "teacher_step"]

_METHODS = ("train_step", "get_weights", "set_weights")


@runtime_checkable
class Step(Protocol):
    """One synchronous data-parallel training step with readable, settable weights."""

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """Run one update on the global batch ``(x, y)``; returns the loss (any form)."""

    def get_weights(self) -> list[np.ndarray]:
        """The weights as NumPy arrays, in ``model.weights`` order."""

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Set every replica's copy of every weight."""


def _missing(value: Any) -> list[str]:
    return [m for m in _METHODS if not callable(getattr(value, m, None))]


def is_step(value: Any) -> bool:
    """``value`` has the protocol's three methods."""
    return not _missing(value)


def check_step(name: str, value: Any) -> Step:
    """``value`` when it is a step; else a TypeError naming ``name`` and what it lacks."""
    missing = _missing(value)
    if missing:
        raise TypeError(f"{name} must be a step (train_step(x, y, sample_weight=None), "
                        f"get_weights(), set_weights(ws)); {type(value).__name__} lacks "
                        f"{', '.join(missing)}: wrap a step function with "
                        "towers.testing.as_step(fn, model)")  # fmt: skip
    return value


def step_towers(step: Any) -> int | None:
    """A step's tower count: its ``devices``, or its strategy's replicas; None if unknown."""
    devices = getattr(step, "devices", None)
    if devices:
        return len(devices)
    strategy = getattr(step, "strategy", None)
    return None if strategy is None else int(strategy.num_replicas_in_sync)


class AdaptedStep:
    """A user's step function as a :class:`Step` (made by :func:`as_step`)."""

    def __init__(self, fn: Callable[[Any], Any], model: Any, *, strategy: Any = None,
                 optimizer: Any = None, loss: Any = None) -> None:  # fmt: skip
        self.fn, self.model, self.strategy, self.loss_fn = fn, model, strategy, loss
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """Call the step function on the batch (distributed by the strategy, if any)."""
        batch = (x, y) if sample_weight is None else (x, y, sample_weight)
        if self.strategy is None:
            return self.fn(batch)
        data = tf.data.Dataset.from_tensors(tf.nest.map_structure(tf.convert_to_tensor, batch))
        return self.fn(next(iter(self.strategy.experimental_distribute_dataset(data))))

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights (replica 0's copy under a strategy)."""
        return [np.array(v.numpy()) for v in self.model.weights]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign the model's weights (every replica's copy under a strategy)."""
        with self.strategy.scope() if self.strategy else contextlib.nullcontext():
            self.model.set_weights([np.asarray(w) for w in weights])


def as_step(fn: Callable[[Any], Any], model: Any, *, strategy: Any = None,
            optimizer: Any = None, loss: Any = None) -> AdaptedStep:  # fmt: skip
    """A user's step function ``fn`` (called with one batch ``(x, y)`` or ``(x, y,
    sample_weight)``, under ``strategy`` if any) as a :class:`Step` whose weights are
    ``model``'s; ``optimizer`` (default ``model.optimizer``) and ``loss`` size the bound."""
    if not callable(fn):
        raise TypeError(f"fn must be a step function (called with one batch), got {fn!r}")
    if not hasattr(model, "weights"):
        raise TypeError(f"model must be the keras.Model the step trains, got {model!r}")
    return AdaptedStep(fn, model, strategy=strategy, optimizer=optimizer, loss=loss)


def take_batches(batches: Iterable[Any], steps: int | None) -> list[tuple[Any, Any]]:
    """The first ``steps`` batches (all when None) as ``(x, y)`` pairs (ValueError: fewer,
    or a batch that is not a pair)."""
    optional(positive_int, "steps", steps)
    out = []
    for k, batch in enumerate(batches):
        if steps is not None and k == steps:
            break
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"batches[{k}] must be an (x, y) pair, got {type(batch).__name__}")
        out.append((np.asarray(batch[0]), np.asarray(batch[1])))
    if not out or (steps is not None and len(out) < steps):
        raise ValueError(f"batches: need {steps or 1} (x, y) batch(es), got {len(out)}")
    return out


class StepGradients(NamedTuple):
    """One run's step: tower 0's ``reduced`` gradients, the all-reduce's input
    ``towers[tower][var]`` (NumPy), and the ``phases`` that ``trainer.apply`` takes."""

    reduced: list[np.ndarray]
    towers: list[list[np.ndarray]]
    phases: Any


def _dense(values: Sequence[Any]) -> list[np.ndarray]:
    return [np.asarray(tf.convert_to_tensor(g)) for g in values]


def step_gradients(trainer: Any, x: Any, y: Any) -> StepGradients:
    """The step's public phases, eagerly: ``split → forward_backward → reduce``."""
    grads = trainer.forward_backward(trainer.split(x, y))
    reduced = trainer.reduce(grads)
    return StepGradients(_dense(reduced.grads[0]), [_dense(g) for g in grads.grads], reduced)


def _within(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> bool:
    return bool(np.all(np.abs(got.astype(np.float64) - want) <= tol))


def compare_runs(label: int | str, step: int, names: Sequence[str],
                 runs: tuple[StepGradients, StepGradients], depths: Sequence[int],
                 kernels: list[np.ndarray] | None) -> list[Difference]:
    """Run B against run A (the reference), bounded and attributed as the module says;
    ``kernels``: the kernel part's bound per variable, or None (the same shards: the
    measured difference of the exact tower sums)."""
    (a, b), (depth_a, depth_b) = runs, depths
    exact_a, tol_a = exact_sums(a.towers, depth_a)
    exact_b, tol_b = exact_sums(b.towers, depth_b)
    if kernels is None:
        kernels = [np.abs(ea - eb) for ea, eb in zip(exact_a, exact_b, strict=True)]
    total = [ta + tb + k for ta, tb, k in zip(tol_a, tol_b, kernels, strict=True)]
    rows = compare_gradients(label, step, names, b.reduced, a.reduced, total)
    for j, row in enumerate(rows):
        if not row.ok:  # the part that left its own bound
            ours = _within(b.reduced[j], exact_b[j], tol_b[j])
            theirs = _within(a.reduced[j], exact_a[j], tol_a[j])
            cause = "kernels" if ours and theirs else "reduction (reference)" if ours else (
                f"reduction ({label})")
            rows[j] = dataclasses.replace(row, cause=cause)
    return rows


def compare_gradients(label: int | str, step: int, names: Sequence[str], got: Sequence[np.ndarray],
                      want: Sequence[np.ndarray], bounds: Sequence[np.ndarray]) -> list[Difference]:
    """One :class:`Difference` per variable: ``|got − want|`` against ``bounds``."""
    rows = []
    for j, (name, a, b, tol) in enumerate(zip(names, got, want, bounds, strict=True)):
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64)).ravel()
        tol = np.broadcast_to(tol, a.shape).ravel()
        bad = ~(diff <= tol)  # NaN counts as outside
        ratio = np.where(bad, np.inf, diff / np.where(tol > 0, tol, 1.0))
        worst = int(np.argmax(ratio)) if diff.size else 0
        at = (float(diff[worst]), float(tol[worst])) if diff.size else (0.0, 0.0)
        top = float(np.max(diff, initial=0.0))
        rows.append(Difference(label, step, name, j, top, worst, *at, not bool(np.any(bad))))
    return rows


def advance(step: Any, x: Any, y: Any) -> list[np.ndarray]:
    """One update of ``step``, its weights after it (a towers trainer through its phases,
    eagerly: a stateful reduction is called once per variable, as in compare_runs)."""
    if isinstance(step, TowerTrainer):
        step.apply(step_gradients(step, x, y).phases)
    else:
        step.train_step(x, y)
    return step.get_weights()


def teacher_step(
    a: Any, others: Sequence[Any], x: Any, y: Any, bound: Any, labels: Sequence[int | str],
    step: int, kernels: Callable[[], list[Any]] | None = None,
) -> list[tuple[list[Difference], list[np.ndarray], list[np.ndarray]]]:
    """Each of ``others`` from A's weights, one step, then A's step: per other (one
    ``Difference`` per compared variable, A's and its compared values).

    ``bound`` None: towers trainers, on their reduced gradients (``kernels()``, called after
    A's gradients: per other the kernel part's bound; None: the same shards); else an
    ``UpdateBound`` on the weights after one update (a tolerance None: not compared).
    """
    weights = a.get_weights()
    if bound is None:
        want = step_gradients(a, x, y)
        names = [v.path for v in a.model.trainable_variables]
        parts = kernels() if kernels is not None else [None] * len(others)
        out = []
        for b, label, kernel in zip(others, labels, parts, strict=True):
            b.set_weights(weights)
            got = step_gradients(b, x, y)
            depths = [summation_depth(getattr(t, "algorithm", None), len(t.devices))
                      for t in (a, b)]  # fmt: skip
            rows = compare_runs(label, step, names, (want, got), depths, kernel)
            out.append((rows, want.reduced, got.reduced))
        a.apply(want.phases)
        return out
    tol = bound.tolerances(weights, x, y)  # sized at the weights both start from
    after_a = advance(a, x, y)
    keep = [i for i, t in enumerate(tol) if t is not None]
    model = getattr(a, "model", None)
    names = [model.weights[i].path if model is not None else f"weights[{i}]" for i in keep]
    want_a = [after_a[i] for i in keep]
    out = []
    for b, label in zip(others, labels, strict=True):
        b.set_weights(weights)
        after_b = advance(b, x, y)
        got_b = [after_b[i] for i in keep]
        rows = compare_gradients(label, step, names, got_b, want_a, [tol[i] for i in keep])
        out.append((rows, want_a, got_b))
    return out
