"""The α-β-γ cost model: every algorithm's time as ``a·α + b·β + c·γ``, fitted and extrapolated.

    model.py       links (α, β, γ), presets, :func:`coefficients` and :func:`predict`
                   (each algorithm's formula lives in its registry record)
    fitting.py     :func:`fit` α, β, γ to measured rows, :func:`compare`, held-out checks
    simulation.py  :func:`simulate` to 1024 towers and :func:`plot_simulation`

Importing this package needs NumPy only (no TensorFlow, no matplotlib): the registry (and
with it TensorFlow) is read when an algorithm's formula is first asked for, matplotlib when
a plot is drawn.

Example:
    >>> from towers.bench import costmodel
    >>> h100 = costmodel.PRESETS["h100-nvlink"]
    >>> costmodel.predict("ring", 8, 1 << 30, h100)  # seconds   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from towers.bench.costmodel import model
from towers.bench.costmodel.fitting import (
    SPLITS,
    compare,
    fit,
    format_table,
    holdout,
    split_sizes,
)
from towers.bench.costmodel.model import (
    DEFAULT_TOWERS,
    NCCL_H100_RING_BUSBW,
    PRESETS,
    Coefficients,
    Link,
    algbw,
    busbw,
    coefficients,
    predict,
)
from towers.bench.costmodel.simulation import plot_simulation, simulate

__all__ = [
    "ALGORITHMS", "DEFAULT_TOWERS", "NCCL_H100_RING_BUSBW", "PRESETS", "SPLITS", "Coefficients",
    "Link", "algbw", "busbw", "coefficients", "compare", "fit", "format_table", "holdout",
    "plot_simulation", "predict", "simulate", "split_sizes",
]


def __getattr__(name: str) -> Any:
    """``ALGORITHMS``: the names :func:`coefficients` knows (read from the registry)."""
    return getattr(model, name)
