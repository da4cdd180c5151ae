"""One step's gradient traffic, measured on the simulated towers and priced on real machines.

The bytes are measured: :attr:`~towers.step.TowerTrainer.last_step_stats` counts every
``send`` of the traced step, and only gradient traffic is kept
(:func:`~towers.allreduce.machinery.primitives.traffic_kind`: the loss, state and guard
sends are bookkeeping). The time is predicted by the α-β-γ model
(:mod:`towers.bench.costmodel`) on the systems of :mod:`towers.bench.costmodel.paper`
(``8xH100``: NVLink 4; ``1024xH100``: 400 Gb/s InfiniBand between nodes), at *their*
GPU count N, from what the step did at the simulated n::

    step time(N) = Σ over the all-reduce calls  predict(algorithm, N, payload)
                 + (N-1)/(n-1) · max over towers (messages·α + bytes·β)   other sends

The first term prices each dense all-reduce the codec made (PowerSGD: P and Q;
fp16: the halved gradient) with the algorithm's own formula. The second charges the
sends outside an all-reduce (top-k's gathers: every tower sends its payload to every
other) by the single-port model, at the busiest tower, grown from n-1 to N-1 peers:
right for gathers from everyone, which is what the built-in codecs make. Without a
cost formula (a user's all-reduce or reducer) there is no prediction (None).

Example:
    >>> traffic = step_traffic(trainer.last_step_stats, counted, "ring", devices)  # +SKIP
    >>> traffic.seconds["1024xH100"]                                                # +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from towers.allreduce.machinery.primitives import StepStats, Transfer, traffic_kind
from towers.bench.costmodel import model
from towers.bench.costmodel.paper import SYSTEMS, predict_on
from towers.study.specs import Counted

__all__ = ["SYSTEMS", "StepTraffic", "other_seconds", "step_traffic"]


@dataclasses.dataclass(frozen=True)
class StepTraffic:
    """One step's gradient traffic: measured bytes, and predicted seconds per system."""

    gradient_bytes: int  # all towers together
    gradient_bytes_per_tower: int  # the busiest tower
    bookkeeping_bytes: int
    seconds: dict[str, float | None]


def other_seconds(transfers: Sequence[Transfer], n: int, system: str) -> float:
    """Single-port time of ``transfers`` at the busiest tower, grown from n-1 to N-1 peers."""
    if n < 2 or not transfers:
        return 0.0
    link, big = SYSTEMS[system]["link"], SYSTEMS[system]["n"]
    load: dict[tuple[str, str], list[int]] = {}
    for t in transfers:  # a port sends one message at a time, and receives one
        for port in ((t.src, "send"), (t.dst, "receive")):
            entry = load.setdefault(port, [0, 0])
            entry[0], entry[1] = entry[0] + 1, entry[1] + (t.nbytes or 0)
    busiest = max(count * link.alpha + nbytes * link.beta for count, nbytes in load.values())
    return busiest * (big - 1) / (n - 1)


def _seconds(
    calls: Sequence[tuple[int, tuple[Transfer, ...]]], others: Sequence[Transfer],
    algorithm: str | None, n: int, system: str,
) -> float | None:
    if algorithm is None or (calls and algorithm not in model.ALGORITHMS):
        return None
    dense = sum(predict_on(system, algorithm, payload) for payload, _ in calls)
    return dense + other_seconds(others, n, system)


def step_traffic(
    stats: StepStats, counted: Counted | None, algorithm: str | None, devices: Sequence[str],
    systems: Sequence[str] = tuple(SYSTEMS),
) -> StepTraffic:
    """Measure the last traced step's gradient bytes and predict its communication time.

    Args:
        stats: the trainer's ``last_step_stats``.
        counted: the step's counted all-reduce (None: nothing is predicted).
        algorithm: the cost model's name for it (None: nothing is predicted).
        devices: the towers.
        systems: names in :data:`SYSTEMS`.

    Returns:
        A :class:`StepTraffic`.
    """
    seen = {id(t) for t in stats.transfers}
    calls = [] if counted is None else [
        c for c in counted.calls if c[1] and id(c[1][0]) in seen]  # this trace's calls
    inside = {id(t) for _, transfers in calls for t in transfers}
    gradients = [t for t in stats.transfers if traffic_kind(t.note) == "gradients"]
    others = [t for t in gradients if id(t) not in inside]
    per_tower = stats.gradient_bytes_per_tower
    return StepTraffic(
        gradient_bytes=stats.gradient_bytes,
        gradient_bytes_per_tower=max((per_tower.get(d, 0) for d in devices), default=0),
        bookkeeping_bytes=stats.bookkeeping_bytes,
        seconds={s: None if counted is None else _seconds(calls, others, algorithm,
                                                            len(devices), s) for s in systems},
    )
