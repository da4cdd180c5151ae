"""Interleaved timing: every configuration once per round, in a seeded shuffled order, so
medians, minima and paired ratios see the same load drift.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import keras

from towers.guard.arguments import positive_int

__all__ = ["Samples", "interleave", "load_average", "paired_ratio"]


@dataclasses.dataclass
class Samples:
    """Per-call seconds of one configuration: ``wall[r]`` and ``cpu[r]`` for round ``r``."""

    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        """Median wall seconds per call."""
        return statistics.median(self.wall)

    @property
    def minimum(self) -> float:
        """Fastest wall seconds per call (the least disturbed round)."""
        return min(self.wall)

    @property
    def cpu_median(self) -> float:
        """Median CPU seconds per call, summed over this process's threads."""
        return statistics.median(self.cpu)


def load_average() -> tuple[float, float, float]:
    """``os.getloadavg()`` (1, 5, 15 minutes), or zeros where the OS has none."""
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux/macOS
        return (0.0, 0.0, 0.0)


def _sample(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall0) / calls, (time.process_time() - cpu0) / calls


def interleave(
    fns: Mapping[str, Callable[[], Any]], rounds: int, *,
    calls: int | Mapping[str, int] = 1, warmup: int = 2, verbose: bool = False,
    label: str = "", seed: int = 0,
) -> dict[str, Samples]:
    """Time every function ``rounds`` times, round-robin, after ``warmup`` untimed calls each.

    ``calls``: calls averaged into one sample, one number or one per name; ``verbose``: a
    progress bar under ``label``; ``seed`` seeds the shuffles.
    """
    names = list(fns)
    per_name = {n: calls if isinstance(calls, int) else calls.get(n, 1) for n in names}
    positive_int("rounds", rounds)
    for name, count in per_name.items():
        positive_int(f"calls[{name!r}]", count)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    out = {name: Samples() for name in names}
    if verbose and label:
        print(label, flush=True)
    bar = keras.utils.Progbar(rounds, stateful_metrics=["load"], verbose=int(verbose))
    order = random.Random(seed)
    for r in range(rounds):
        for name in order.sample(names, len(names)):
            wall, cpu = _sample(fns[name], per_name[name])
            out[name].wall.append(wall)
            out[name].cpu.append(cpu)
        bar.update(r + 1, [("load", load_average()[0])])
    return out


def paired_ratio(samples: Samples, reference: Samples) -> float:
    """Median over rounds of ``samples.wall[r] / reference.wall[r]`` (drift cancels per round)."""
    return statistics.median(a / b for a, b in zip(samples.wall, reference.wall))
