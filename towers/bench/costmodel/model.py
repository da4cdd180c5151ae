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

Each algorithm's formula is its registry record's ``cost`` (``towers.allreduce.machinery.registry``;
the function lives beside the schedule in the algorithm's module); only the calibration
rows ``send`` and ``add`` are defined here. How the less obvious rows come about:

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
  (on ``inner_link``), ``outer`` among the ``⌈n/k⌉`` leaders on ``S`` (on ``link``), then
  each leader copies the result to its ``k-1`` members. When ``k`` does not divide ``n``
  the last group is smaller and the inner phase costs its slowest group.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from towers.guard.arguments import non_negative_float, positive_int

__all__ = [
    "ALGORITHMS", "DEFAULT_TOWERS", "NCCL_H100_RING_BUSBW", "PRESETS", "Coefficients", "Link",
    "algbw", "busbw", "coefficients", "predict",
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
            non_negative_float(f"Link.{field}", getattr(self, field))

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


# The per-algorithm formulas live in the algorithms' records
# (``towers.allreduce.machinery.registry``,
# each module's ``cost``); here only the two calibration rows, which are not algorithms.
def _send(n: int, s: float) -> Coefficients:
    return 1, s, 0


def _add(n: int, s: float) -> Coefficients:
    return 0, 0, (n - 1) * s


_CALIBRATION = ("send", "add")
_CALIBRATION_FORMULAS: dict[str, Callable[..., Coefficients]] = {"send": _send, "add": _add}


def _formulas() -> dict[str, Callable[..., Coefficients]]:
    """Every name with a cost: the registered algorithms' records, and the calibration rows.

    Imported when first needed, so this module loads without TensorFlow.
    """
    from towers.allreduce.machinery.registry import ALGORITHMS as records  # TensorFlow: kept lazy

    costs = {name: r.cost for name, r in records.items() if r.cost is not None}
    return {**costs, **_CALIBRATION_FORMULAS}


ALGORITHMS: tuple[str, ...]  # computed on first access by __getattr__ (below)


def __getattr__(name: str) -> Any:
    """``ALGORITHMS``: the names :func:`coefficients` knows, sorted (read from the registry)."""
    if name == "ALGORITHMS":
        return tuple(sorted(_formulas()))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_size(n: Any, nbytes: Any) -> int:
    n = positive_int("n", n)
    non_negative_float("nbytes", nbytes)
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
    formulas = _formulas()
    if algorithm not in formulas:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(sorted(formulas))}")
    n = _check_size(n, nbytes)
    formula = formulas[algorithm]
    accepted = inspect.signature(formula).parameters
    for key in params:
        if key not in accepted or key in ("n", "nbytes", "s"):
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
    from towers.allreduce.hierarchical import cost_levels  # TensorFlow: kept lazy

    # Only the outer level crosses groups.
    within, among = cost_levels(n, float(nbytes), **params)
    return sum(a * lk.alpha + b * lk.beta + c * lk.gamma
               for (a, b, c), lk in ((within, inner_link), (among, link)))


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
    positive_int("n", n)
    return algbw(nbytes, seconds) * 2 * (n - 1) / n
