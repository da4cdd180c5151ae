"""One step from the same weights: the shared machinery of ``check_invariance`` and ``bisect``.

Two runs start a step from the same weights (teacher forcing) and their reduced
gradients are compared element by element against a bound on each run's rounding::

    W_s ──▶ run A: split → forward_backward → reduce ──▶ G_A ─┐
        ──▶ run B: split → forward_backward → reduce ──▶ G_B ─┴─ |G_A − G_B| ≤ b_A + b_B
        ──▶ one tower step per example (independent) ──▶ c_e ──▶ b = γ_{d+1}·Σ_e|c_e|

A reduced gradient is a sum over the batch's examples of each example's gradient
``c_e``: a tower's kernels add the examples of its shard, the all-reduce adds the
towers. Whatever the grouping, a run adds the ``B`` leaves in a tree of depth at
most ``d = (largest shard − 1) + k_algo(n)`` (``k_algo`` from the algorithm's
registry record; ``n − 1``, which bounds every tree of ``n`` leaves, for a callable
without one), plus one rounding for the product inside each leaf (a MatMul may fuse
it). So each run lies within ``γ_{d+1}·Σ_e|c_e|`` of the exact sum
(:func:`towers.testing.bounds.sum_bound`, the one derivation) and two runs within
the sum of their bounds. The bound assumes each example's own forward and backward
values are computed alike at every shard size (row-wise kernels: the batch is the
only dimension the runs re-associate); where a kernel breaks that, the comparison
reports it rather than hiding it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.testing.bounds import sum_bound

__all__ = [
    "Difference",
    "compare_gradients",
    "example_gradients",
    "leaf_bounds",
    "reduced_gradients",
    "run_depth",
    "take_batches",
]


@dataclasses.dataclass(frozen=True)
class Difference:
    """One variable's largest difference at one step, and the bound it is held to.

    Attributes:
        towers: the tower count of the run compared (or a configuration's label).
        step: the step, counted from 1.
        variable: the variable's path (``model.trainable_variables`` order).
        index: its position in that order.
        max_diff: the largest |difference| over its elements.
        worst: the flat index of the element with the largest ``diff / bound``.
        worst_diff: the |difference| at that element.
        bound: the bound at that element.
        ok: every element within its bound.
    """

    towers: int | str
    step: int
    variable: str
    index: int
    max_diff: float
    worst: int
    worst_diff: float
    bound: float
    ok: bool


def take_batches(batches: Iterable[Any], steps: int | None) -> list[tuple[Any, Any]]:
    """The first ``steps`` batches (all when None) as ``(x, y)`` pairs.

    Raises:
        ValueError: no batches, fewer than ``steps``, a batch that is not ``(x, y)``,
            or ``steps`` not an integer >= 1.
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an integer >= 1 or None, got {steps!r}")
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


def reduced_gradients(trainer: Any, x: Any, y: Any) -> tuple[list[np.ndarray], Any]:
    """The step's phases, eagerly: ``split → forward_backward → reduce``.

    Returns:
        (tower 0's reduced gradient per trainable variable as dense NumPy arrays, the
        ``Reduced`` that ``trainer.apply`` takes).
    """
    reduced = trainer.reduce(trainer.forward_backward(trainer.split(x, y)))
    grads = [np.asarray(tf.convert_to_tensor(g)) for g in reduced.grads[0]]
    return grads, reduced


def example_gradients(
    model: keras.Model, loss: Any, x: Any, y: Any, device: str
) -> list[list[np.ndarray]]:
    """Each example's gradient of its share of the global mean loss: ``leaves[e][var]``.

    One tower step per example (global batch ``B``, ``B`` towers, so regularization
    losses are shared out as ``B`` towers would): the independent path that sizes the
    bound, never the thing under test.
    """
    from towers.tower import resolve_loss, tower_step

    fn = resolve_loss(loss)
    trainable = [tf.convert_to_tensor(v.value) for v in model.trainable_variables]
    frozen = [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables]
    batch = len(x)
    leaves = []
    for e in range(batch):
        result = tower_step(
            model, trainable, frozen, (x[e : e + 1], y[e : e + 1], None), loss_fn=fn,
            global_batch=tf.constant(batch), num_towers=batch, device=device,
        )  # fmt: skip
        leaves.append([np.asarray(tf.convert_to_tensor(g)) for g in result.grads])
    return leaves


def run_depth(trainer: Any, batch: int) -> int:
    """How many roundings any leaf goes through in this run's reduced gradient.

    ``(largest shard − 1)`` additions inside a tower, ``k_algo(n)`` in the all-reduce
    (its record's ``summation_depth``, else ``n − 1``), one for the product in the leaf.
    """
    from towers.allreduce.registry import record_of
    from towers.split import shard_sizes

    n = len(trainer.devices)
    record = record_of(trainer.algorithm)
    depth = record.summation_depth(n) if record is not None else None
    return max(shard_sizes(batch, n)) - 1 + (n - 1 if depth is None else depth) + 1


def compare_gradients(
    label: int | str,
    step: int,
    names: Sequence[str],
    got: Sequence[np.ndarray],
    want: Sequence[np.ndarray],
    bounds: Sequence[np.ndarray],
) -> list[Difference]:
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


def leaf_bounds(leaves: list[list[np.ndarray]], depth_a: int, depth_b: int) -> list[np.ndarray]:
    """Per variable, the element-wise bound on two runs of depths ``depth_a``, ``depth_b``."""
    out = []
    for j in range(len(leaves[0])):
        column = [leaf[j] for leaf in leaves]
        out.append(sum_bound(column, "sum", depth_a)[1] + sum_bound(column, "sum", depth_b)[1])
    return out
