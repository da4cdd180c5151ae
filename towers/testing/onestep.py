"""One step from the same weights: the machinery ``compare``, ``bisect`` and invariance share.

Two runs start a step from the same weights (teacher forcing); their reduced gradients are
compared element by element, the difference split by the triangle inequality into parts
each with its own derived bound (:func:`towers.testing.bounds.sum_bound`)::

    W_s ─▶ run A: split → forward_backward ─▶ g_A[tower] ─▶ reduce ─▶ G_A
    W_s ─▶ run B: split → forward_backward ─▶ g_B[tower] ─▶ reduce ─▶ G_B

    |G_A − G_B| ≤ |G_A − Σg_A| + |Σg_A − Σg_B| + |Σg_B − G_B|      Σ: exact (float64)
                  reduction A    kernels        reduction B

*Reduction*: within ``γ_k·Σ_i|g_i|`` of the observed tower gradients' exact sum, ``k`` the
algorithm's summation depth. *Kernels*: with equal tower counts both runs' towers see the
same shards (any difference is measured and added); across tower counts each tower sum is
a tree of depth ``largest shard − 1`` (+1 for the product inside a leaf) over the batch's
per-example gradients. That part assumes an example's own values are computed alike at
every shard size: oneDNN's MatMul blocks by batch size and breaks it (run with
``TF_ENABLE_ONEDNN_OPTS=0``). A difference outside the bound is attributed to the part
that left its own bound, so kernel noise is never blamed on the all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from towers.guard.arguments import optional, positive_int
from towers.split import shard_sizes
from towers.step import TowerTrainer
from towers.testing.bounds import exact_sums, summation_depth
from towers.testing.report import Difference

__all__ = ["StepGradients", "advance", "algorithm_depth", "compare_gradients", "compare_runs",
           "kernel_depth", "step_gradients", "take_batches", "update_rows"]


def take_batches(batches: Iterable[Any], steps: int | None) -> list[tuple[Any, Any]]:
    """The first ``steps`` batches (all when None) as ``(x, y)`` pairs.

    Raises:
        ValueError: no batches, fewer than ``steps``, a batch that is not ``(x, y)``,
            or ``steps`` not an integer >= 1.
    """
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


def algorithm_depth(trainer: Any) -> int:
    """A towers trainer's all-reduce summation depth."""
    return summation_depth(getattr(trainer, "algorithm", None), len(trainer.devices))


def kernel_depth(batch: int, towers: int) -> int:
    """Roundings of a leaf inside a tower: ``largest shard − 1`` additions, one product."""
    return max(shard_sizes(batch, towers))


def _within(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> bool:
    return bool(np.all(np.abs(got.astype(np.float64) - want) <= tol))


def compare_runs(
    label: int | str, step: int, names: Sequence[str], runs: tuple[StepGradients, StepGradients],
    depths: tuple[int, int], kernels: list[np.ndarray] | None,
) -> list[Difference]:
    """Run B against run A (the reference), bounded and attributed as the module says.

    Args:
        runs, depths: ``(A, B)`` and their all-reduce depths.
        kernels: the kernel part's bound per variable (different tower counts), or
            None: the same shards, so the measured difference of the exact tower sums.
    """
    (a, b), (depth_a, depth_b) = runs, depths
    exact_a, tol_a = exact_sums(a.towers, depth_a)
    exact_b, tol_b = exact_sums(b.towers, depth_b)
    if kernels is None:
        kernels = [np.abs(ea - eb) for ea, eb in zip(exact_a, exact_b, strict=True)]
    total = [ta + tb + k for ta, tb, k in zip(tol_a, tol_b, kernels, strict=True)]
    rows = compare_gradients(label, step, names, b.reduced, a.reduced, total)
    for j, row in enumerate(rows):
        if row.ok:
            continue
        if not _within(b.reduced[j], exact_b[j], tol_b[j]):
            cause = f"reduction ({label})"
        elif not _within(a.reduced[j], exact_a[j], tol_a[j]):
            cause = "reduction (reference)"
        else:
            cause = "kernels"
        rows[j] = dataclasses.replace(row, cause=cause)
    return rows


def compare_gradients(
    label: int | str,
    step: int,
    names: Sequence[str],
    got: Sequence[np.ndarray],
    want: Sequence[np.ndarray],
    bounds: Sequence[np.ndarray],
) -> list[Difference]:
    """One :class:`~towers.testing.report.Difference` per variable: ``|got − want|`` against
    ``bounds``."""
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


def update_rows(
    a: Any, after_a: list[np.ndarray], others: list[Any], weights: list[np.ndarray],
    tol: list[Any], x: Any, y: Any, label: int | str, step: int,
) -> list[tuple[list[Difference], list[np.ndarray], list[np.ndarray]]]:
    """Each of ``others`` set to ``weights`` and advanced once, against A's ``after_a``.

    Returns:
        Per other step: (one ``Difference`` per compared weight, A's and its weights).
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
