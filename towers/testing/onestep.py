"""One step from the same weights: the shared machinery of ``check_invariance`` and ``bisect``.

Two runs start a step from the same weights (teacher forcing); their reduced
gradients are compared element by element, and the difference is split by the
triangle inequality into parts each with its own derived bound::

    W_s ─▶ run A: split → forward_backward ─▶ g_A[tower] ─▶ reduce ─▶ G_A
    W_s ─▶ run B: split → forward_backward ─▶ g_B[tower] ─▶ reduce ─▶ G_B

    |G_A − G_B| ≤ |G_A − Σg_A| + |Σg_A − Σg_B| + |Σg_B − G_B|      Σ: exact (float64)
                  reduction A    kernels        reduction B

*Reduction.* An all-reduce of depth ``k`` lies within ``γ_k·Σ_i|g_i|`` of the exact
sum of the towers' gradients it was given (:func:`towers.testing.bounds.sums.sum_bound`,
the one derivation): ``k`` from the algorithm's registry record, ``n − 1`` (which
bounds every tree of ``n`` leaves) for a callable without one. No assumption: the
leaves are the observed tower gradients.

*Kernels.* With the same tower count both runs give their towers the same shards,
so ``Σg_A = Σg_B`` (bitwise equal inputs; any difference is measured and added).
Across tower counts the towers' kernels add a shard's examples, so each tower sum
is a tree over the batch's per-example gradients ``c_e``: each run lies within
``γ_{d+1}·Σ_e|c_e|`` of their exact sum, ``d = largest shard − 1`` (+1 for the
product inside a leaf, which a MatMul may fuse). The leaves come from an
independent path, one tower step per example. This part assumes each example's
own forward and backward values are computed alike at every shard size (row-wise
kernels: only the batch dimension is re-associated). TensorFlow's Eigen kernels do;
oneDNN's MatMul (on by default on x86) blocks by batch size and breaks it, by a few
hundred ULPs of ``Σ|c_e|`` where a gradient cancels (measured; run with
``TF_ENABLE_ONEDNN_OPTS=0`` to hold kernels to it). A difference outside the bound
is attributed to the part that left its own bound, so a kernel effect is never
blamed on the all-reduce. A ``tf.distribute`` reference exposes no gradient: against
one, :func:`update_step` compares one plain-SGD update within ``sgd_step_bound``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.registry import record_of
from towers.guard.arguments import optional, positive_int
from towers.split import shard_sizes
from towers.testing.bounds.sums import exact_sums, sgd_step_bound
from towers.testing.strategies import per_tower_gradients
from towers.tower import tower_step
from towers.training.keras_loss import resolve_loss

__all__ = [
    "Difference",
    "StepGradients",
    "algorithm_depth",
    "compare_gradients",
    "compare_runs",
    "example_gradients",
    "kernel_depth",
    "plain_sgd_rate",
    "run_devices",
    "step_gradients",
    "take_batches",
    "update_step",
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
        cause: when not ok, the part that left its own bound: ``"reduction (…)"`` or
            ``"kernels"`` (see the module docstring).
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
    cause: str = ""


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
    """One run's gradients of one step, as NumPy arrays.

    Attributes:
        reduced: tower 0's reduced gradient per trainable variable.
        towers: ``towers[tower][var]``, the all-reduce's input.
        phases: the ``Reduced`` that ``trainer.apply`` takes.
    """

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


def example_gradients(
    model: keras.Model, loss: Any, x: Any, y: Any, device: str
) -> list[list[np.ndarray]]:
    """Each example's gradient of its share of the global mean loss: ``leaves[e][var]``.

    One tower step per example (global batch ``B``, ``B`` towers, so regularization
    losses are shared out as ``B`` towers would): the independent path that sizes the
    bound, never the thing under test.
    """
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


def run_devices(trainer: Any) -> list[str]:
    """A towers trainer's devices, or a ``tf.distribute`` reference's replicas."""
    return list(getattr(trainer, "devices", None) or trainer.strategy.extended.worker_devices)


def algorithm_depth(trainer: Any) -> int:
    """The all-reduce's summation depth: its record's, else ``n − 1`` (any tree of n leaves;
    also a ``tf.distribute`` reference's, whose collective order is not ours to know)."""
    n = len(run_devices(trainer))
    record = record_of(getattr(trainer, "algorithm", None))
    depth = record.summation_depth(n) if record is not None else None
    return n - 1 if depth is None else depth


def kernel_depth(batch: int, towers: int) -> int:
    """Roundings of a leaf inside a tower: ``largest shard − 1`` additions, one product."""
    return max(shard_sizes(batch, towers)) - 1 + 1


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


def plain_sgd_rate(optimizer: keras.optimizers.Optimizer) -> float:
    """The learning rate of a plain SGD optimizer (one update shows its gradient).

    Raises:
        ValueError: another optimizer, or SGD with momentum.
    """
    if type(optimizer) is not keras.optimizers.SGD or float(optimizer.momentum) != 0.0:
        raise ValueError(
            "optimizer_fn: against a tf.distribute reference bisect compares one update from "
            "the same weights, which shows the gradient only for plain SGD (no momentum); got "
            f"{type(optimizer).__name__}"
        )
    return float(np.asarray(optimizer.learning_rate))


def update_step(
    runs: tuple[Any, Any], x: Any, y: Any, loss: Any, lr: float, label: int | str, step: int
) -> tuple[list[Difference], list[np.ndarray], list[np.ndarray]]:
    """One plain-SGD step of both runs from A's weights, within ``sgd_step_bound``.

    A towers run steps through its phases, eagerly; a reference through ``train_step``.

    Returns:
        (one :class:`Difference` per trainable weight, A's and B's weights after the step).
    """
    a, b = runs
    weights = a.get_weights()
    b.set_weights(weights)
    trainable = [i for i, v in enumerate(a.model.weights) if v.trainable]
    grads = per_tower_gradients(a.model, x, y, run_devices(a), loss=loss)
    depth = max(algorithm_depth(a), algorithm_depth(b))
    tol = sgd_step_bound([weights[i] for i in trainable], grads, lr, depth=depth)
    after = []
    for run in runs:
        if hasattr(run, "algorithm"):
            run.apply(step_gradients(run, x, y).phases)
        else:
            run.train_step(x, y)
        now = run.get_weights()
        after.append([now[i] for i in trainable])
    names = [a.model.weights[i].path for i in trainable]
    return compare_gradients(label, step, names, after[1], after[0], tol), after[0], after[1]
