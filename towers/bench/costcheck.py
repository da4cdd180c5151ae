"""Does the α-β-γ cost model explain the measured all-reduce times?

Each contender's rows (one per size) are fitted on their own by
:func:`towers.bench.costmodel.fit` with ``per_algorithm=True``; then
:func:`towers.bench.costmodel.compare` gives predicted against measured time per row.
A contender passes when every size is predicted within ``tolerance`` (25 %).
tf.distribute's ops are modelled by the formula of what they run on logical CPUs
(``CollectiveAllReduce``: a ring; ``ReductionToOneDevice``: naive).

Every all-reduce formula moves twice the bytes it reduces (``b = 2c``), so the
rows fix α and ``2β + γ`` only (fit warns; any split of the two predicts the same
times). The summary reports that effective per-byte cost as a bandwidth,
``1 / (2β + γ)`` in bytes reduced per second. The ``send``/``add`` calibration
rows would split β from γ, but on logical CPUs a send passes a pointer (β ≈ 0)
and their call overhead would dominate the fit, so they are reported, not fitted.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Sequence
from typing import Any

from towers.bench import costmodel
from towers.bench.allreduce import cost_rows

__all__ = ["TOLERANCE", "check_cost_model"]

TOLERANCE = 0.25


def _fit_one(rows: list[dict[str, Any]]) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        links = costmodel.fit(rows, per_algorithm=True, name="cpu")
    return links, [str(w.message) for w in caught]


def check_cost_model(
    rows: Sequence[dict[str, Any]], tolerance: float = TOLERANCE
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Fit per contender and compare.

    Args:
        rows: :func:`towers.bench.allreduce.run_allreduce` rows (with calibration rows).
        tolerance: largest accepted ``|predicted / measured - 1|``.

    Returns:
        ``(details, summary)``: one dict per (contender, size) with ``measured``,
        ``predicted`` and ``rel_error``; one dict per contender with the fitted
        ``alpha``, ``per_byte`` (``2β + γ``), ``median_abs_error``, ``max_abs_error``, ``ok``.
    """
    modelled = [r for r in cost_rows(rows) if r["algorithm"] not in ("send", "add")]
    names = list(dict.fromkeys(r["name"] for r in modelled))
    details: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for name in names:
        own = [r for r in modelled if r["name"] == name]
        formula = own[0]["algorithm"]
        links, notes = _fit_one(own)
        link = links[formula]
        compared = costmodel.compare(own, links)
        errors = [abs(c["rel_error"]) for c in compared]
        details.extend({"algorithm": name, "formula": formula, **c} for c in compared)
        summary.append({
            "algorithm": name, "formula": formula, "alpha": link.alpha,
            "per_byte": 2 * link.beta + link.gamma, "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors), "ok": max(errors) <= tolerance, "notes": notes,
        })
    return details, summary
