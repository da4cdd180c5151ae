"""Does the α-β-γ cost model explain the measured all-reduce times, and predict them?

Each contender's rows (one per size) are fitted on their own by
:func:`towers.bench.costmodel.fitting.fit` with ``per_algorithm=True``; then
:func:`towers.bench.costmodel.fitting.compare` gives predicted against measured time per row.
That is the in-sample fit: it says how well the formula's shape can follow the rows,
not how well it predicts. For that, :func:`towers.bench.costmodel.fitting.holdout` fits on some
sizes and predicts the others, two ways (:data:`towers.bench.costmodel.fitting.SPLITS`):
``interleaved`` (every other size trains; the held-out sizes lie between them) and
``extrapolated`` (the smaller half trains; the larger half is predicted). The same
training sizes serve every contender (:func:`split_sizes`). A contender passes when
every size is within ``tolerance`` (25 %): ``ok`` in-sample, ``<split>_ok`` held out.
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
from collections.abc import Callable, Sequence
from typing import Any

from towers.bench.allreduce import cost_rows
from towers.bench.costmodel import fitting as costfit

__all__ = ["TOLERANCE", "check_cost_model", "split_sizes"]

TOLERANCE = 0.25


def _quiet(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """``call(*args, **kwargs)`` and its warnings as strings (fit's "2β + γ only" note)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call(*args, **kwargs)
    return out, [str(w.message) for w in caught]


def _modelled(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in cost_rows(rows) if r["algorithm"] not in ("send", "add")]


def split_sizes(rows: Sequence[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Per split, ``(training sizes, held-out sizes)`` over all modelled rows' sizes."""
    sizes = [r["nbytes"] for r in _modelled(rows)]
    return {how: costfit.split_sizes(sizes, how) for how in costfit.SPLITS}


def _heldout(own: list[dict[str, Any]], train: list[float]) -> list[dict[str, Any]] | None:
    """:func:`costfit.holdout` of one contender; None without 2 training sizes and 1 held out."""
    seen = {r["nbytes"] for r in own}
    if len(seen & set(train)) < 2 or not seen - set(train):
        return None
    return _quiet(costfit.holdout, own, set(train), name="cpu")[0]


def _errors(compared: list[dict[str, Any]], prefix: str, tolerance: float) -> dict[str, Any]:
    errors = [abs(c["rel_error"]) for c in compared if not c.get("train")]
    if not errors:
        return {f"{prefix}median_abs_error": None, f"{prefix}max_abs_error": None,
                f"{prefix}ok": None}
    return {f"{prefix}median_abs_error": statistics.median(errors),
            f"{prefix}max_abs_error": max(errors), f"{prefix}ok": max(errors) <= tolerance}


def check_cost_model(
    rows: Sequence[dict[str, Any]], tolerance: float = TOLERANCE
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Fit per contender and compare, in-sample and on held-out sizes.

    Args:
        rows: :func:`towers.bench.allreduce.run_allreduce` rows (with calibration rows).
        tolerance: largest accepted ``|predicted / measured - 1|``.

    Returns:
        ``(details, summary)``: one dict per (contender, size) with ``measured``,
        ``predicted`` and ``rel_error`` (in-sample), and per split ``<split>_train``
        (whether that fit saw the row), ``<split>_predicted``, ``<split>_error``;
        one dict per contender with the fitted ``alpha``, ``per_byte`` (``2β + γ``),
        ``median_abs_error``, ``max_abs_error``, ``ok`` (in-sample) and per split
        ``<split>_median_abs_error``, ``<split>_max_abs_error``, ``<split>_ok`` over
        the held-out rows (None where a contender has too few sizes to split).
    """
    modelled = _modelled(rows)
    splits = split_sizes(rows)
    details: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for name in dict.fromkeys(r["name"] for r in modelled):
        own = [r for r in modelled if r["name"] == name]
        formula = own[0]["algorithm"]
        links, notes = _quiet(costfit.fit, own, per_algorithm=True, name="cpu")
        compared = costfit.compare(own, links)
        heldout = {how: _heldout(own, train) for how, (train, _) in splits.items()}
        for i, c in enumerate(compared):
            row = {"algorithm": name, "formula": formula, **c}
            for how, held in heldout.items():
                row[f"{how}_train"] = held[i]["train"] if held else None
                row[f"{how}_predicted"] = held[i]["predicted"] if held else None
                row[f"{how}_error"] = held[i]["rel_error"] if held else None
            details.append(row)
        link = links[formula]
        summary.append({
            "algorithm": name, "formula": formula, "alpha": link.alpha,
            "per_byte": 2 * link.beta + link.gamma, **_errors(compared, "", tolerance),
            **{k: v for how, held in heldout.items()
               for k, v in _errors(held or [], f"{how}_", tolerance).items()},
            "notes": notes,
        })
    return details, summary
