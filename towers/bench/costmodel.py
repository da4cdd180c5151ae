"""The α-β-γ cost model of towers' all-reduce schedules: formulas, presets, predictions.

A message of ``m`` bytes costs ``α + m·β``; reducing ``m`` bytes costs ``m·γ``; a tower sends
and receives one message at a time. Each algorithm's formula is its registry record's ``cost``.

References: Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations
in MPICH", IJHPCA 2005; NVIDIA nccl-tests ``doc/PERFORMANCE.md`` (algbw and busbw).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from towers.allreduce.hierarchical import cost_levels
from towers.allreduce.machinery.registry import ALGORITHMS as RECORDS
from towers.guard.arguments import non_negative_float, positive_int

__all__ = [
    "DEFAULT_TOWERS", "NCCL_H100_RING_BUSBW", "PRESETS", "SYSTEMS", "Coefficients", "Link",
    "algbw", "busbw", "coefficients", "formulas", "predict", "predict_on", "scale_on_paper",
]

Coefficients = tuple[float, float, float]
DEFAULT_TOWERS = tuple(2**i for i in range(1, 11))
NCCL_H100_RING_BUSBW = 370e9
"""Published busbw (bytes/s) of NCCL's ring all-reduce on 8×H100 NVLink 4, large messages."""


@dataclass(frozen=True)
class Link:
    """A link: ``alpha`` s per message, ``beta`` s per byte sent, ``gamma`` s per byte added."""

    alpha: float
    beta: float
    gamma: float
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("alpha", "beta", "gamma"):
            non_negative_float(f"Link.{field}", getattr(self, field))

    @property
    def bandwidth(self) -> float:
        return math.inf if self.beta == 0 else 1.0 / self.beta


# γ: an add reads two bytes and writes one per byte reduced, so γ = 3 / memory bandwidth.
PRESETS: dict[str, Link] = {
    # NVLink 4: 18 links × 25 GB/s = 450 GB/s per direction; HBM3 3.35 TB/s (H100 SXM
    # datasheet). α: a few µs to launch a peer copy or kernel.
    "h100-nvlink": Link(alpha=3e-6, beta=1 / 450e9, gamma=3 / 3.35e12, name="h100-nvlink"),
    # PCIe 4.0 x16: ~25 GB/s after TLP headers; A100-40GB HBM2e 1.555 TB/s.
    "pcie4": Link(alpha=5e-6, beta=1 / 25e9, gamma=3 / 1.555e12, name="pcie4"),
    # 100 Gb/s InfiniBand = 12.5 GB/s; a GPU collective step 5-10 µs; H100s at the ends.
    "ib-100g": Link(alpha=7e-6, beta=1 / 12.5e9, gamma=3 / 3.35e12, name="ib-100g"),
    # 400 Gb/s NDR InfiniBand = 50 GB/s per direction per GPU, ~8 µs a step.
    "ib-400g": Link(alpha=8e-6, beta=1 / 50e9, gamma=3 / 3.35e12, name="ib-400g"),
}

SYSTEMS: dict[str, dict[str, Any]] = {
    "8xH100": {"n": 8, "link": PRESETS["h100-nvlink"], "inner": None, "per_node": 8,
               "anchor": ("nccl-tests ring busbw", NCCL_H100_RING_BUSBW)},
    "1024xH100": {"n": 1024, "link": PRESETS["ib-400g"], "inner": PRESETS["h100-nvlink"],
                  "per_node": 8, "anchor": ("NIC line rate (bound)", 50e9)},
}
"""The machines :func:`predict_on` prices; ``anchor``: a published busbw, or a bound."""


def formulas() -> dict[str, Callable[..., Coefficients]]:
    """Every name with a cost: the registry's (read now: it grows) and ``send``/``add``."""
    costs = {name: r.cost for name, r in RECORDS.items() if r.cost is not None}
    return {**costs, "send": lambda n, s: (1, s, 0), "add": lambda n, s: (0, 0, (n - 1) * s)}


def coefficients(algorithm: str, n: int, nbytes: float, **params: Any) -> Coefficients:
    """``(a, b, c)`` such that the time is ``a·α + b·β + c·γ``; ``params``: the formula's.

    Example:
        >>> coefficients("ring", 4, 1000.0)
        (6, 1500.0, 750.0)
    """
    known = formulas()
    if algorithm not in known:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(sorted(known))}")
    n = positive_int("n", n)
    non_negative_float("nbytes", nbytes)
    accepted = inspect.signature(known[algorithm]).parameters
    for key in params:
        if key not in accepted or key in ("n", "nbytes", "s"):
            raise ValueError(f"{algorithm} takes no parameter {key!r}")
    if n == 1:
        return 0, 0, 0
    return known[algorithm](n, float(nbytes), **params)


def predict(algorithm: str, n: int, nbytes: float, link: Link, **params: Any) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` per tower over ``n`` towers
    (``hierarchical`` takes ``inner_link=``, the link within a group).

    Example:
        >>> round(predict("ring", 8, 1 << 30, PRESETS["h100-nvlink"]) * 1e3, 2)
        5.06
    """
    inner_link = params.pop("inner_link", None)
    if inner_link is None:
        a, b, c = coefficients(algorithm, n, nbytes, **params)
        return a * link.alpha + b * link.beta + c * link.gamma
    if algorithm != "hierarchical":
        raise ValueError(f"inner_link applies to 'hierarchical' only, not {algorithm!r}")
    if not isinstance(inner_link, Link):
        raise ValueError(f"inner_link must be a Link, got {inner_link!r}")
    if coefficients(algorithm, n, nbytes, **params) == (0, 0, 0):  # validates; n = 1
        return 0.0
    within, among = cost_levels(n, float(nbytes), **params)  # only the outer crosses groups
    return sum(a * lk.alpha + b * lk.beta + c * lk.gamma
               for (a, b, c), lk in ((within, inner_link), (among, link)))


def predict_on(system: str, algorithm: str, nbytes: float) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` per GPU on ``SYSTEMS[system]``."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    machine = SYSTEMS[system]
    params: dict[str, Any] = {}
    if algorithm == "hierarchical":
        params = {"inner": "ring", "outer": "ring", "group_size": machine["per_node"]}
        if machine["inner"] is not None:
            params["inner_link"] = machine["inner"]
    return predict(algorithm, machine["n"], nbytes, machine["link"], **params)


def scale_on_paper(algorithms: Sequence[str] = ("ring", "tree", "double_binary_tree",
                                                "halving_doubling", "swing", "hierarchical"),
                   sizes: Sequence[int] = (1 << 20, 1 << 30)) -> list[dict[str, Any]]:
    """One row per (system, algorithm, size): predicted µs, algbw and busbw (GB/s)."""
    rows = []
    for name, system in SYSTEMS.items():
        anchor, anchor_busbw = system["anchor"]
        for algorithm in (a for a in algorithms if a in formulas()):
            for nbytes in sizes:
                seconds = predict_on(name, algorithm, nbytes)
                rows.append({"system": name, "algorithm": algorithm, "size": nbytes,
                             "time_us": seconds * 1e6, "algbw": algbw(nbytes, seconds) / 1e9,
                             "busbw": busbw(nbytes, seconds, system["n"]) / 1e9,
                             "anchor": anchor, "anchor_busbw": anchor_busbw / 1e9})
    return rows


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s, ``S / t`` (nccl-tests; divide by 1e9 for GB/s)."""
    non_negative_float("nbytes", nbytes)
    if not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"seconds must be finite and > 0, got {seconds!r}")
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s, ``algbw · 2(n-1)/n`` (comparable across tower counts)."""
    positive_int("n", n)
    return algbw(nbytes, seconds) * 2 * (n - 1) / n
