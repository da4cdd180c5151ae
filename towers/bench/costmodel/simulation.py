"""The α-β-γ model carried past the hardware at hand: predicted time up to 1024 towers.

:func:`simulate` gives :func:`towers.bench.costmodel.predict` at each tower count;
:func:`plot_simulation` draws it, log-log, one line per algorithm (matplotlib, Agg,
imported only when plotting).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from towers.bench.costmodel import model as costmodel
from towers.bench.costmodel.model import DEFAULT_TOWERS, Link

__all__ = ["plot_simulation", "simulate"]


def simulate(
    algorithm: str, towers: Sequence[int], nbytes: float, link: Link, **params: Any
) -> list[float]:
    """Predicted seconds for each tower count in ``towers``.

    Example:
        >>> simulate("naive", [1, 2], 0, Link(1e-6, 0, 0))
        [0.0, 2e-06]
    """
    return [costmodel.predict(algorithm, n, nbytes, link, **params) for n in towers]


def _or_nan(algorithm: str, n: int, nbytes: float, link: Link, params: Mapping[str, Any]) -> float:
    try:
        return costmodel.predict(algorithm, n, nbytes, link, **params)
    except ValueError:  # a tower count the algorithm cannot take (group_size must divide n)
        return math.nan


def plot_simulation(
    algorithms: Sequence[str] | Mapping[str, Mapping[str, Any]],
    towers: Sequence[int] = DEFAULT_TOWERS, *, nbytes: float, link: Link, path: str | Path,
) -> Path:
    """Plot predicted time against tower count (log-log) and save a PNG to ``path``.

    Args:
        algorithms: names, or a mapping name -> params (``{"hierarchical": {"group_size": 8}}``);
            tower counts an algorithm cannot take are left out of its line.
        towers: the tower counts (x axis).
        nbytes, link: as for :func:`predict`.
        path: where to write the PNG.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: an unknown algorithm or parameter.

    Example:
        >>> from towers.bench.costmodel.model import PRESETS
        >>> plot_simulation(["ring", "tree"], nbytes=2**26,
        ...                 link=PRESETS["ib-100g"], path="ring_vs_tree.png")  # doctest: +SKIP
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: keep import cheap
    from matplotlib.figure import Figure

    specs = algorithms if isinstance(algorithms, Mapping) else {a: {} for a in algorithms}
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for algorithm, params in specs.items():
        costmodel.coefficients(algorithm, 1, nbytes, **params)  # a bad name or parameter raises
        ax.plot(towers, [_or_nan(algorithm, n, nbytes, link, params) for n in towers],
                marker="o", label=algorithm)
    ax.set(xscale="log", yscale="log", xlabel="towers", ylabel="predicted seconds",
           title=f"all-reduce of {nbytes / 2**20:g} MiB per tower on {link.name or 'link'}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(Path(path), format="png", dpi=100)
    return Path(path)
