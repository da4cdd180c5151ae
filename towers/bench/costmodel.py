"""The α-β-γ cost model of towers' all-reduce schedules: formulas and predictions.

A message of ``m`` bytes costs ``α + m·β`` on a link; reducing ``m`` bytes costs
``m·γ``. Every algorithm's time is linear in the three constants,
``t = a·α + b·β + c·γ``; :func:`coefficients` gives ``(a, b, c)`` for ``n``
towers and ``S`` bytes, :func:`predict` the seconds, :func:`fit` the constants
from measured rows. A tower sends one and receives one message at a time
(single-port, full duplex, as in Thakur et al.), so messages through one port add up.

    ==========================  ===================================================
    naive, parameter_device     2m·(α + S·β) + (n-1)·S·γ     (m = n-1; n off-tower)
    ring (s sub-chunks)         2(n-1)s·α + 2(n-1)/n·S·β + (n-1)/n·S·γ
    nccl, nccl_ring             ring with s = 1
    nccl_tree (binomial)        2⌈lg n⌉·(α + S·β) + ⌈lg n⌉·S·γ
    tree (C pieces)             M·(α + S/C·β) + A·S/C·γ     (full tree, C = 1: M = 4D, A = 2D)
    double_binary_tree          M·(α + S/2C·β) + A·S/2C·γ   (M, A of both trees' schedule)
    halving_doubling            (2h + 2f)·α + (2(p-1)/p + 2f)·S·β + ((p-1)/p + f)·S·γ
    hierarchical                inner(k, S) + outer(n/k, S) + (k-1)·(α + S·β)
    send / add (calibration)    α + S·β  /  (n-1)·S·γ
    ==========================  ===================================================

How the less obvious rows come about:

- naive / parameter_device: all traffic crosses the root's one port. It receives
  ``m`` messages of ``S`` one after another (``m·(α + S·β)``), adds ``n-1`` of them
  (``(n-1)·S·γ``) and sends ``m`` back (``m·(α + S·β)``); ``m = n-1`` when the root
  is a tower (its own value stays), ``m = n`` for a separate parameter device.
- ring: sub-chunks keep the bytes but make ``s`` messages of ``S/(n·s)`` per tick.
- tree, double_binary_tree: the ticks of ``allreduce/tree.py``'s schedule (a node
  of height ``h`` sends piece ``k`` up at tick ``h + k``; at depth ``d`` it copies it
  down at ``D + d + k``) over the binary heap, or over NCCL's two trees carrying
  ``S/2`` each. Each tick costs its busiest port: ``M`` sums the most messages on any
  port per tick, ``A`` the most pieces any tower adds. For a full binary tree
  (``D = ⌊lg n⌋ ≥ 2``) ``M = 2(2D + C - 1)``, plus ``C - 1`` ticks of three messages when
  ``C ≥ 3`` (up and down overlap), and ``A = 2(D + C - 1)``:
  more pieces trade α for β, towards ``3S·β + 2S·γ`` (an inner node sends ``3S``).
  Two trees, each tower inner in one and a leaf in the other, bring that to
  ``2S·β + S·γ``, the ring's bandwidth with ``~2D`` instead of ``2(n-1)`` latencies.
- halving_doubling: ``p = 2^h ≤ n``; ``f = 1`` when ``n > p``: the extra towers fold
  in (send ``S``, the partner adds) before and fold out (receive ``S``) after.
- hierarchical (``allreduce/hierarchical.py``): ``inner`` on each group of ``k``
  (on ``inner_link``), ``outer`` among the ``n/k`` leaders on ``S`` (on ``link``), then
  each leader copies the result to its ``k-1`` members.

naive, parameter_device on a tower, ring and halving_doubling move twice the bytes
they reduce (``b = 2c``): their timings fix only ``2β + γ``. :func:`fit` warns when
its rows cannot separate α, β and γ; ``send`` and ``add`` rows can.

References:
    Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
    Operations in MPICH", IJHPCA 2005; Sanders, Speck, Träff, "Two-tree algorithms
    for full bandwidth broadcast, reduction and scan", Parallel Computing 2009;
    NVIDIA nccl-tests ``doc/PERFORMANCE.md`` (algbw and busbw).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

__all__ = [
    "ALGORITHMS", "DEFAULT_TOWERS", "NCCL_H100_RING_BUSBW", "PRESETS", "Link", "algbw", "busbw",
    "coefficients", "compare", "fit", "format_table", "plot_simulation", "predict", "simulate",
]

Coefficients = tuple[float, float, float]
DEFAULT_TOWERS = tuple(2**i for i in range(1, 11))
NCCL_H100_RING_BUSBW = 370e9
"""Published busbw (bytes/s) of NCCL ring all-reduce on 8×H100 NVLink 4, large messages.

``predict("ring", 8, 1 << 30, PRESETS["h100-nvlink"])`` gives 371 GB/s. The match is
closer than the model deserves: it adds γ (a separate add kernel, as towers' own
algorithms run it) after the copies, while NCCL fuses the add into its copy loop. With
γ = 0 the model says 446 GB/s, 21% high: NCCL reaches ~82% of NVLink's raw 450 GB/s,
the rest going to NVLink packet headers and flow control and to NCCL's protocol
(flags, synchronisation between pipeline steps), which the model does not see.
"""


@dataclass(frozen=True)
class Link:
    """A link's constants: ``alpha`` s per message, ``beta`` s per byte, ``gamma`` s per byte added.

    Example:
        >>> Link(alpha=5e-6, beta=1 / 12.5e9, gamma=0.0, name="ib").bandwidth
        12500000000.0
    """

    alpha: float
    beta: float
    gamma: float
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("alpha", "beta", "gamma"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Link.{field} must be a finite number >= 0, got {value!r}")

    @property
    def bandwidth(self) -> float:
        """Bytes per second per direction (``1/β``)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta


# γ: an add reads two bytes and writes one per byte reduced, so γ = 3 / memory bandwidth.
PRESETS: dict[str, Link] = {
    # NVLink 4: 18 links × 25 GB/s = 450 GB/s per direction (H100 SXM datasheet); HBM3
    # 3.35 TB/s (same). α: a few µs to launch a peer copy or kernel (CUDA launch latency).
    "h100-nvlink": Link(alpha=3e-6, beta=1 / 450e9, gamma=3 / 3.35e12, name="h100-nvlink"),
    # PCIe 4.0 x16: 16 GT/s × 16 lanes × 128/130 = 31.5 GB/s raw; ~25 GB/s after TLP headers
    # (typical cudaMemcpy figure). A100-40GB HBM2e 1.555 TB/s as the PCIe-era GPU.
    "pcie4": Link(alpha=5e-6, beta=1 / 25e9, gamma=3 / 1.555e12, name="pcie4"),
    # 100 Gb/s InfiniBand = 12.5 GB/s; verbs latency ~1 µs, a GPU collective step 5-10 µs.
    # γ: H100s at the ends, as above.
    "ib-100g": Link(alpha=7e-6, beta=1 / 12.5e9, gamma=3 / 3.35e12, name="ib-100g"),
    # Logical CPU devices share host memory: a placeholder of plausible magnitude (TF op
    # dispatch ~50 µs, memcpy ~10 GB/s, a one-core add ~3 GB/s). Replace it with fit().
    "cpu-logical": Link(alpha=50e-6, beta=1 / 10e9, gamma=1 / 3e9, name="cpu-logical"),
}


def _lg_floor(n: int) -> int:
    return n.bit_length() - 1


def _lg_ceil(n: int) -> int:
    return (n - 1).bit_length()


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _naive(n: int, s: float) -> Coefficients:
    return _parameter_device(n, s, on_tower=True)


def _parameter_device(n: int, s: float, *, on_tower: bool = True) -> Coefficients:
    m = n - 1 if on_tower else n  # messages each way through the root's one port
    return 2 * m, 2 * m * s, (n - 1) * s


def _ring(n: int, s: float, *, subchunks: int = 1) -> Coefficients:
    subchunks = _positive_int("subchunks", subchunks)
    return 2 * (n - 1) * subchunks, 2 * (n - 1) / n * s, (n - 1) / n * s


def _nccl_ring(n: int, s: float) -> Coefficients:
    return _ring(n, s)


def _nccl_tree(n: int, s: float) -> Coefficients:
    d = _lg_ceil(n)  # binomial levels: one message per tower per level, each way
    return 2 * d, 2 * d * s, d * s


def _heights_depths(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    depth = [-1] * len(parents)
    def find(i: int) -> int:
        if depth[i] < 0:
            depth[i] = 0 if parents[i] < 0 else find(parents[i]) + 1
        return depth[i]
    height = [0] * len(parents)
    for i in sorted(range(len(parents)), key=find, reverse=True):  # children first
        if parents[i] >= 0:
            height[parents[i]] = max(height[parents[i]], height[i] + 1)
    return height, depth


def _ticks(trees: Sequence[Sequence[int]], chunks: int) -> tuple[float, float]:
    """``(M, A)``: Σ over ticks of the most messages on one port and pieces added by one tower.

    Ports are columns ``[0, n)`` (out), ``[n, 2n)`` (in); adds ``[2n, 3n)``. Each
    event lasts ``chunks`` ticks (one piece per tick), so loads only change where an
    event starts or ends: count on those segments, weighted by their length.
    """
    n = len(trees[0])
    starts, cols = [], []
    for parents in trees:
        height, depth = _heights_depths(parents)
        top = max(height)
        for i, p in enumerate(parents):
            if p >= 0:  # up: i → p at tick height[i]; down: p → i at tick top + depth[p]
                starts += [height[i]] * 3 + [top + depth[p]] * 2
                cols += [i, n + p, 2 * n + p, p, n + i]
    begin, where = np.array(starts), np.array(cols)
    bounds = np.unique(np.concatenate([begin, begin + chunks]))
    load = np.zeros((len(bounds), 3 * n))
    np.add.at(load, (np.searchsorted(bounds, begin), where), 1)
    np.add.at(load, (np.searchsorted(bounds, begin + chunks), where), -1)
    load, width = np.cumsum(load, axis=0)[:-1], np.diff(bounds)
    return (float(width @ load[:, : 2 * n].max(axis=1)),
            float(width @ load[:, 2 * n :].max(axis=1)))


def _heap(n: int) -> list[int]:
    return [(i - 1) // 2 if i else -1 for i in range(n)]


def _double_trees(n: int) -> list[list[int]]:
    """NCCL's trees (``ncclGetBtree``); the second mirrored (even n) or shifted (odd n)."""
    first = [-1] * n
    for rank in range(1, n):
        bit = rank & -rank
        first[rank] = (rank ^ bit) | (bit << 1) if (rank ^ bit) | (bit << 1) < n else rank ^ bit
    if n % 2 == 0:
        return [first, [-1 if first[n - 1 - r] < 0 else n - 1 - first[n - 1 - r] for r in range(n)]]
    return [first, [-1 if first[r - 1] < 0 else (first[r - 1] + 1) % n for r in range(n)]]


def _tree(n: int, s: float, *, chunks: int = 1) -> Coefficients:
    messages, adds = _ticks([_heap(n)], _positive_int("chunks", chunks))
    piece = s / chunks
    return messages, messages * piece, adds * piece


def _double_binary_tree(n: int, s: float, *, chunks: int = 1) -> Coefficients:
    messages, adds = _ticks(_double_trees(n), _positive_int("chunks", chunks))
    piece = s / (2 * chunks)
    return messages, messages * piece, adds * piece


def _halving_doubling(n: int, s: float) -> Coefficients:
    h = _lg_floor(n)
    p = 1 << h
    a, b, c = 2 * h, 2 * (p - 1) / p * s, (p - 1) / p * s
    if n > p:  # fold in (send S, partner adds) and fold out (receive S)
        a, b, c = a + 2, b + 2 * s, c + s
    return a, b, c


def _levels(
    n: int, s: float, *, inner: str = "naive", outer: str = "ring", group_size: int = 2
) -> list[tuple[str, int, float]]:
    """Hierarchical's parts: ``[(inner, k, S), (outer, n/k, S), ("send", k, S) × (k-1)]``."""
    k = _positive_int("group_size", group_size)
    if n % k:
        raise ValueError(f"group_size={k} does not divide the tower count n={n}")
    for key, name in (("inner", inner), ("outer", outer)):
        if name not in _FORMULAS or name in ("hierarchical", *_CALIBRATION):
            raise ValueError(f"{key} must be a flat all-reduce name, got {name!r}")
    return [(inner, k, s), (outer, n // k, s)] + [("send", 2, s)] * (k - 1)


def _hierarchical(n: int, s: float, **params: Any) -> Coefficients:
    parts = [coefficients(name, k, size) for name, k, size in _levels(n, s, **params)]
    return tuple(float(sum(col)) for col in zip(*parts, strict=True))  # type: ignore[return-value]


def _send(n: int, s: float) -> Coefficients:
    return 1, s, 0


def _add(n: int, s: float) -> Coefficients:
    return 0, 0, (n - 1) * s


_CALIBRATION = ("send", "add")
_FORMULAS: dict[str, Callable[..., Coefficients]] = {
    "naive": _naive, "parameter_device": _parameter_device, "ring": _ring,
    "nccl": _nccl_ring, "nccl_ring": _nccl_ring, "tree": _tree,
    "double_binary_tree": _double_binary_tree, "nccl_tree": _nccl_tree,
    "halving_doubling": _halving_doubling, "hierarchical": _hierarchical,
    "send": _send, "add": _add,
}
ALGORITHMS = tuple(sorted(_FORMULAS))


def _check_size(n: Any, nbytes: Any) -> int:
    n = _positive_int("n", n)
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real):
        raise ValueError(f"nbytes must be a number, got {nbytes!r}")
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be finite and >= 0, got {nbytes!r}")
    return n


def coefficients(algorithm: str, n: int, nbytes: float, **params: Any) -> Coefficients:
    """``(a, b, c)`` such that the time is ``a·α + b·β + c·γ`` (see the module table).

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        n: tower count (``n = 1`` costs nothing).
        nbytes: bytes per tower (``S``).
        **params: ``subchunks`` (ring), ``chunks`` (tree, double_binary_tree),
            ``on_tower`` (parameter_device), ``inner``/``outer``/``group_size``
            (hierarchical).

    Raises:
        ValueError: an unknown algorithm (listing the known ones), a bad ``n``, ``nbytes``
            or parameter (naming it).

    Example:
        >>> coefficients("ring", 4, 1000.0)
        (6, 1500.0, 750.0)
    """
    if algorithm not in _FORMULAS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    n = _check_size(n, nbytes)
    formula = _FORMULAS[algorithm]
    accepted = inspect.signature(_levels if algorithm == "hierarchical" else formula).parameters
    for key in params:
        if key not in accepted or key in ("n", "s"):
            raise ValueError(f"{algorithm} takes no parameter {key!r}")
    if n == 1:
        return 0, 0, 0
    return formula(n, float(nbytes), **params)


def predict(algorithm: str, n: int, nbytes: float, link: Link, **params: Any) -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` per tower over ``n`` towers.

    Args:
        algorithm, n, nbytes, **params: as for :func:`coefficients`.
        link: the link's constants. For ``hierarchical``, ``inner_link=`` gives the
            intra-group link (default: ``link`` for both levels).

    Raises:
        ValueError: as :func:`coefficients`; ``inner_link`` on another algorithm.

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
    levels = _levels(n, float(nbytes), **params)  # only the outer level (1) crosses groups
    return sum(predict(name, k, size, link if i == 1 else inner_link)
               for i, (name, k, size) in enumerate(levels))


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s, ``S / t`` (nccl-tests; divide by 1e9 for GB/s).

    Example:
        >>> algbw(1e9, 0.5)
        2000000000.0
    """
    _check_size(1, nbytes)
    if not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"seconds must be finite and > 0, got {seconds!r}")
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s, ``algbw · 2(n-1)/n``: comparable across tower counts.

    Every element needs 2(n-1)/n transfers per tower whatever the algorithm, so busbw
    measures what the hardware delivered (nccl-tests ``doc/PERFORMANCE.md``).

    Example:
        >>> busbw(1e9, 0.5, 4)
        3000000000.0
    """
    _positive_int("n", n)
    return algbw(nbytes, seconds) * 2 * (n - 1) / n


_MOVED = {"fit": "costfit", "compare": "costfit", "format_table": "costfit",
          "simulate": "simulate", "plot_simulation": "simulate"}
"""Names that live in a sibling module now: ``costmodel.fit`` is ``costfit.fit``."""

if TYPE_CHECKING:
    from towers.bench.costfit import compare, fit, format_table
    from towers.bench.simulate import plot_simulation, simulate


def __getattr__(name: str) -> Any:
    # Lazy: costfit and simulate import this module, and importing this one stays cheap.
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"towers.bench.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
