"""What exactness costs: the non-finite guard, and the as-written barrier around the update.

Five steps of one model, timed in the same shuffled rounds::

    CentralStorageStrategy                      the best tf.distribute step here
    towers  skip    nested   (the default)     guard on,  update behind its barrier
    towers  ignore  nested                     guard off, update behind its barrier
    towers  skip    inlined  (calibration)     guard on,  update traced into the step
    towers  ignore  inlined  (calibration)     guard off, update traced into the step

    guard share   = median_r (skip_r / ignore_r) - 1           (same update form)
    barrier share = median_r (nested_r / inlined_r) - 1        (same guard mode)
    x CSS         = median_r (step_r / CentralStorageStrategy_r)

The *barrier* is :class:`~towers.compile.step.PhasedStep`'s nested
update: a call op that keeps Grappler's reordering passes off the reduction, so the sums
happen in the stated order, but that starts only when every tower's gradients are ready
and runs as its own executor pass. The *inlined* rows trace the same update into the step
under TensorFlow's default settings (``PhasedStep(barrier=False)``): Grappler may then
reorder the sums, so it is a calibration, never a trainer's form. Every trainer is
built from the same seeded model, SGD and batch; ``"ignore"`` traces the unguarded graph
(:mod:`towers.guard.nonfinite`). Load drifts cancel per round; the absolute
milliseconds beside the ratios do not, so read the ratios.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.bench.timing import interleave, paired_ratio
from towers.bench.training import MODELS, _baselines, _sgd, make_batch
from towers.compile.step import PhasedStep
from towers.step import TowerTrainer

__all__ = ["GUARD_ROUNDS", "guard_rounds", "guard_rows", "guard_section", "guard_table"]

MODES = ("skip", "ignore")
FORMS = ("nested", "inlined")
CSS = "CentralStorageStrategy"


def _trainer(model: str, devices: Sequence[str], algorithm: str, placement: str,
             mode: str, form: str) -> TowerTrainer:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer = TowerTrainer(MODELS[model][0], _sgd, loss, devices=list(devices),
                           all_reduce=algorithm, variables=placement, on_nonfinite=mode)
    if form == "inlined":  # the calibration: the same update, no barrier (module docstring)
        compiled = trainer.compiled
        if not compiled.nested:
            raise ValueError("the inlined calibration needs a one-call step (CPU devices)")
        compiled.steps[False] = PhasedStep(functools.partial(compiled.forward, outputs=False),
                                           compiled.update, barrier=False)
    return trainer


def _name(mode: str, form: str) -> str:
    return f"{mode}, {form}"


def guard_rows(
    model: str, devices: Sequence[str], *, algorithm: str = "naive",
    placement: str = "parameter_device", batch: int = 256, rounds: int = 13,
) -> list[dict[str, Any]]:
    """One row per step (module docstring): median wall ms and the paired ratios.

    Args:
        model: a :data:`~towers.bench.training.MODELS` key.
        devices: the towers' devices.
        algorithm, placement: the towers configuration timed.
        batch: the global batch size.
        rounds: interleaved rounds.

    Returns:
        ``[{"model", "config", "on_nonfinite", "update", "ms", "share", "barrier",
        "vs_css"}]``: ``share`` is the guard's (0 on ``ignore`` rows), ``barrier`` the
        nested update's (0 on ``inlined`` rows); both None on the CentralStorageStrategy
        row, whose ``vs_css`` is 1.
    """
    x, y = make_batch(model, batch)
    steps: dict[str, Callable[[], tf.Tensor]] = {
        CSS: _baselines(MODELS[model][0], devices, x, y, names=(CSS,))[0].step}
    for form in FORMS:
        for mode in MODES:
            trainer = _trainer(model, devices, algorithm, placement, mode, form)
            steps[_name(mode, form)] = functools.partial(trainer.train_step, x, y)
    samples = interleave(steps, rounds)
    config = f"towers {algorithm}/{placement}"
    rows = [{"model": model, "config": CSS, "on_nonfinite": "", "update": "",
             "ms": samples[CSS].median * 1e3, "share": None, "barrier": None, "vs_css": 1.0}]
    for form in FORMS:
        for mode in MODES:
            s = samples[_name(mode, form)]
            rows.append({
                "model": model, "config": config, "on_nonfinite": mode, "update": form,
                "ms": s.median * 1e3,
                "share": paired_ratio(s, samples[_name("ignore", form)]) - 1.0,
                "barrier": paired_ratio(s, samples[_name(mode, "inlined")]) - 1.0,
                "vs_css": paired_ratio(s, samples[CSS]),
            })
    return rows


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def guard_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as text: model, configuration, mode, update form, ms, the shares, x CSS."""
    lines = [f"{'model':<11} {'config':<30} {'on_nonfinite':<12} {'update':<8} {'ms':>7} "
             f"{'guard share':>11} {'barrier':>8} {'x CSS':>6}"]
    lines += [f"{r['model']:<11} {r['config']:<30} {r['on_nonfinite'] or '-':<12} "
              f"{r['update'] or '-':<8} {r['ms']:7.1f} {_pct(r['share']) or '-':>11} "
              f"{_pct(r['barrier']) or '-':>8} {r['vs_css']:6.3f}" for r in rows]
    return "\n".join(lines)


GUARD_ROUNDS = 61
"""Rounds of the guard's table (at least): a share of 1–2 % of a 10 ms step is below
the round-to-round spread of 13 rounds on shared cores (measured: −1 % to +8.5 % with
13 rounds, +0.3 % to +1.7 % with 61, same code)."""


def guard_rounds(args: Any) -> int:
    """``--step-rounds`` (5 under ``--quick``), raised to :data:`GUARD_ROUNDS` unless quick."""
    if args.quick:
        return int(args.step_rounds or 5)
    return max(int(args.step_rounds or 0), GUARD_ROUNDS)


def guard_section(args: Any, devices: list[str], results: dict) -> bool:
    """``towers bench --sections guard``: the guard's and the barrier's share, per model."""
    rows: list[dict[str, Any]] = []
    for model in args.models or list(MODELS):
        for placement in args.placements or ("parameter_device", "replicated"):
            rows += guard_rows(model, devices[: args.towers], placement=placement,
                               batch=args.batch_size, rounds=guard_rounds(args))
    print(f"\n== what exactness costs: the guard (skip vs ignore) and the update's barrier "
          f"(nested vs inlined), {guard_rounds(args)} paired rounds")
    print(guard_table(rows))
    results["guard"] = rows
    return True
