"""The α-β-γ cost model: formulas and predictions (``model.py``), fits (``fitting.py``).

Example:
    >>> from towers.bench import costmodel
    >>> round(costmodel.predict("ring", 8, 1 << 30, costmodel.PRESETS["h100-nvlink"]) * 1e3, 2)
    5.06
"""

from __future__ import annotations

from typing import Any

from towers.bench.costmodel import model
from towers.bench.costmodel.fitting import compare, fit, fit_measured, holdout
from towers.bench.costmodel.model import (
    DEFAULT_TOWERS,
    NCCL_H100_RING_BUSBW,
    PRESETS,
    SYSTEMS,
    Coefficients,
    Link,
    algbw,
    busbw,
    coefficients,
    predict,
    predict_on,
    scale_on_paper,
    simulate,
)

__all__ = [
    "ALGORITHMS", "DEFAULT_TOWERS", "NCCL_H100_RING_BUSBW", "PRESETS", "SYSTEMS",
    "Coefficients", "Link", "algbw", "busbw", "coefficients", "compare", "fit",
    "fit_measured", "holdout", "predict", "predict_on", "scale_on_paper", "simulate",
]


def __getattr__(name: str) -> Any:
    """``ALGORITHMS``: the names :func:`coefficients` knows (read from the registry)."""
    return getattr(model, name)
