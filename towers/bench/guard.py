"""What the non-finite guard costs: the same step with ``on_nonfinite="skip"`` and ``"ignore"``.

::

    round r:   skip  ignore  (shuffled)      share = median_r (skip_r / ignore_r) - 1

Both trainers are built from the same seeded model, SGD and batch; ``"ignore"`` traces
the unguarded graph (:mod:`towers.guard.nonfinite`), so the paired ratio of the two
wall times, round by round, is the guard's share of the step. Load drifts cancel per
round; the absolute milliseconds beside the share do not, so read the share.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import keras

from towers.bench.timing import interleave, paired_ratio
from towers.bench.training import MODELS, _sgd, make_batch
from towers.step import TowerTrainer

__all__ = ["GUARD_ROUNDS", "guard_rounds", "guard_rows", "guard_section", "guard_table"]

MODES = ("skip", "ignore")


def _trainer(model: str, devices: Sequence[str], algorithm: str, placement: str,
             mode: str) -> TowerTrainer:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return TowerTrainer(MODELS[model][0], _sgd, loss, devices=list(devices),
                        all_reduce=algorithm, variables=placement, on_nonfinite=mode)


def guard_rows(
    model: str, devices: Sequence[str], *, algorithm: str = "naive",
    placement: str = "parameter_device", batch: int = 256, rounds: int = 13,
) -> list[dict[str, Any]]:
    """One row per mode: median wall ms per step and the guard's share (paired ratio).

    Args:
        model: a :data:`~towers.bench.training.MODELS` key.
        devices: the towers' devices.
        algorithm, placement: the towers configuration timed.
        batch: the global batch size.
        rounds: interleaved rounds.

    Returns:
        ``[{"model", "config", "on_nonfinite", "ms", "share"}]``; ``share`` is the
        median of ``ms(skip) / ms(ignore) - 1`` per round (0 on the ``ignore`` row).
    """
    x, y = make_batch(model, batch)
    trainers = {m: _trainer(model, devices, algorithm, placement, m) for m in MODES}
    samples = interleave({m: functools.partial(t.train_step, x, y) for m, t in trainers.items()},
                         rounds)  # fmt: skip
    config = f"towers {algorithm}/{placement}"
    return [{"model": model, "config": config, "on_nonfinite": m,
             "ms": samples[m].median * 1e3,
             "share": paired_ratio(samples[m], samples["ignore"]) - 1.0} for m in MODES]


def guard_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as text: model, configuration, mode, ms per step, the guard's share."""
    lines = [f"{'model':<11} {'config':<30} {'on_nonfinite':<12} {'ms':>7} {'guard share':>11}"]
    lines += [f"{r['model']:<11} {r['config']:<30} {r['on_nonfinite']:<12} {r['ms']:7.1f} "
              f"{r['share']:+11.1%}" for r in rows]
    return "\n".join(lines)


GUARD_ROUNDS = 41
"""Rounds of the guard's table (at least): a share of 1–2 % of a 10 ms step is below
the round-to-round spread of 13 rounds on shared cores (measured: −1 % to +8.5 % with
13 rounds, +0.3 % to +1.7 % with 61, same code)."""


def guard_rounds(args: Any) -> int:
    """``--step-rounds`` (5 under ``--quick``), raised to :data:`GUARD_ROUNDS` unless quick."""
    if args.quick:
        return int(args.step_rounds or 5)
    return max(int(args.step_rounds or 0), GUARD_ROUNDS)


def guard_section(args: Any, devices: list[str], results: dict) -> bool:
    """``towers bench --sections guard``: the guard's share of the step, per model."""
    rows: list[dict[str, Any]] = []
    for model in args.models or list(MODELS):
        for placement in args.placements or ("parameter_device", "replicated"):
            rows += guard_rows(model, devices[: args.towers], placement=placement,
                               batch=args.batch_size, rounds=guard_rounds(args))
    print(f"\n== the non-finite guard's share of the step (skip vs ignore, "
          f"{guard_rounds(args)} paired rounds)")
    print(guard_table(rows))
    results["guard"] = rows
    return True
