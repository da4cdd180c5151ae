"""The cost model fitted to measured rows (non-negative least squares on relative error)."""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from towers.bench import costmodel, report
from towers.bench.costmodel import Link
from towers.bench.report import num, text

__all__ = ["compare", "fit", "fit_measured", "holdout", "section"]

_CALIBRATION = ("send", "add")  # rows that join every per-algorithm fit (β apart from γ)


def _row(row: Mapping[str, Any]) -> tuple[str, int, float, float, dict[str, Any]]:
    algorithm, n, nbytes, seconds = (row.get(k) for k in ("algorithm", "n", "nbytes", "seconds"))
    if algorithm is None or n is None or nbytes is None or seconds is None:
        raise ValueError(f"rows need algorithm, n, nbytes and seconds; got {row!r}")
    costmodel.algbw(nbytes, seconds)  # validates both
    return algorithm, n, nbytes, seconds, dict(row.get("params") or {})


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: the best of every support set."""
    best, best_x = math.inf, np.zeros(a.shape[1])
    for support in itertools.product((False, True), repeat=a.shape[1]):
        x = np.zeros(a.shape[1])
        if any(support):
            x[list(support)] = np.linalg.lstsq(a[:, list(support)], b, rcond=None)[0]
        residual = float(np.linalg.norm(a @ x - b))
        if x.min() >= 0 and residual < best * (1 - 1e-12):
            best, best_x = residual, x
    return best_x


def _fit_link(rows: list[tuple[str, int, float, float, dict[str, Any]]], name: str) -> Link:
    if not rows:
        raise ValueError("rows is empty: nothing to fit")
    a = np.array([costmodel.coefficients(alg, n, s, **p) for alg, n, s, _, p in rows], dtype=float)
    a = a / np.array([row[3] for row in rows])[:, None]  # relative error: small rows count too
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    if np.linalg.matrix_rank(a / scale) < 3:
        warnings.warn(f"fit {name!r}: the rows do not determine α, β and γ separately "
                      "(ring-like all-reduces fix only 2β + γ): add 'send' and 'add' rows; "
                      "one of many solutions is returned", stacklevel=3)
    alpha, beta, gamma = (float(v) for v in _nnls(a / scale, np.ones(len(rows))) / scale)
    return Link(alpha=alpha, beta=beta, gamma=gamma, name=name)


def fit(rows: Sequence[Any], *, per_algorithm: bool = False, name: str = "fit") -> Any:
    """A :class:`Link` (``per_algorithm``: one per algorithm) fitted to rows of ``algorithm``,
    ``n``, ``nbytes``, ``seconds`` (and ``params``) by NNLS on relative error.

    Example:
        >>> rows = [{"algorithm": "send", "n": 2, "nbytes": s, "seconds": 1e-6 + s * 1e-9}
        ...         for s in (1e3, 1e6)]
        >>> rows.append({"algorithm": "add", "n": 2, "nbytes": 1e6, "seconds": 1e-4})
        >>> round(fit(rows).gamma, 15)
        1e-10
    """
    parsed = [_row(r) for r in rows]
    if not per_algorithm:
        return _fit_link(parsed, name)
    shared = [r for r in parsed if r[0] in _CALIBRATION]
    groups = sorted({r[0] for r in parsed} - set(_CALIBRATION))
    return {g: _fit_link([r for r in parsed if r[0] == g] + shared, f"{name}:{g}") for g in groups}


def compare(rows: Sequence[Any], link_or_links: Link | Mapping[str, Link]) -> list[dict[str, Any]]:
    """Predicted against measured time per row, with ``rel_error = predicted/measured - 1``."""
    out = []
    for algorithm, n, nbytes, seconds, params in (_row(r) for r in rows):
        if isinstance(link_or_links, Mapping) and algorithm not in link_or_links:
            raise ValueError(f"link_or_links has no link for {algorithm!r}")
        link = link_or_links[algorithm] if isinstance(link_or_links, Mapping) else link_or_links
        predicted = costmodel.predict(algorithm, n, nbytes, link, **params)
        out.append({"algorithm": algorithm, "n": n, "nbytes": nbytes, "params": params,
                    "measured": seconds, "predicted": predicted,
                    "rel_error": predicted / seconds - 1})
    return out


def holdout(rows: Sequence[Any], train_sizes: Collection[float], *,
            name: str = "holdout") -> list[dict[str, Any]]:
    """:func:`compare`'s rows for a fit per algorithm on the rows at ``train_sizes`` only."""
    parsed = [_row(r) for r in rows]
    trained = {alg for alg, _, s, _, _ in parsed if s in train_sizes}
    missing = sorted({alg for alg, *_ in parsed} - trained - set(_CALIBRATION))
    if missing:
        raise ValueError(f"no row at a training size for {', '.join(missing)}")
    links = fit([r for r, p in zip(rows, parsed) if p[2] in train_sizes],
                per_algorithm=True, name=name)
    modelled = [r for r, p in zip(rows, parsed) if p[0] not in _CALIBRATION]
    return [{**c, "train": c["nbytes"] in train_sizes} for c in compare(modelled, links)]


def _errors(compared: list[dict[str, Any]], prefix: str) -> dict[str, float | None]:
    errors = [abs(c["rel_error"]) for c in compared if not c.get("train")]
    return {f"{prefix}median_error": statistics.median(errors) if errors else None,
            f"{prefix}max_error": max(errors) if errors else None}


def fit_measured(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per contender of the all-reduce table: α and ``2β + γ`` fitted to its times; the
    error of a fit to every size (``fit_*``) and to every other size (``held_out_*``)."""
    modelled = [{"algorithm": r["formula"], "n": r["n"], "nbytes": r["size"],
                 "seconds": r["time_us"] * 1e-6, "params": r["params"], "name": r["algorithm"]}
                for r in table if r["formula"] not in (None, *_CALIBRATION) and r["time_us"]]
    train = set(sorted({r["nbytes"] for r in modelled})[::2])
    out = []
    for name in dict.fromkeys(r["name"] for r in modelled):
        own = [r for r in modelled if r["name"] == name]
        sizes = {r["nbytes"] for r in own}
        with warnings.catch_warnings():  # "only 2β + γ": expected, as said above
            warnings.simplefilter("ignore")
            link = fit(own)
            held = holdout(own, train & sizes) if len(train & sizes) >= 2 and sizes - train else []
        out.append({"algorithm": name, "formula": own[0]["algorithm"], "alpha": link.alpha,
                    "per_byte": 2 * link.beta + link.gamma,
                    **_errors(compare(own, link), "fit_"), **_errors(held, "held_out_")})
    return out


FIT_COLUMNS: list[report.Column] = [
    ("algorithm\n", "l", text("algorithm")), ("formula\n", "l", text("formula")),
    ("alpha\n(us)", "r", num("alpha", ".1f", 1e6)),
    ("1/(2beta+gamma)\n(GB/s)", "r",
     lambda r: f"{1 / r['per_byte'] / 1e9:.2f}" if r["per_byte"] else "inf"),
    ("fit all sizes\n|err| med %", "r", num("fit_median_error", ".1f", 100)),
    ("\nmax %", "r", num("fit_max_error", ".1f", 100)),
    ("held-out sizes\n|err| med %", "r", num("held_out_median_error", ".1f", 100)),
    ("\nmax %", "r", num("held_out_max_error", ".1f", 100)),
]
PAPER_COLUMNS: list[report.Column] = [
    ("system\n", "l", text("system")), ("algorithm\n", "l", text("algorithm")),
    ("size\n(B)", "r", num("size", "d")), ("time\n(us)", "r", num("time_us", ".1f")),
    ("busbw\n(GB/s)", "r", num("busbw", ".1f")),
    ("published / bound\n(GB/s)", "r", lambda r: f"{r['anchor_busbw']:.0f} {r['anchor']}"),
]


def section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """``--sections costmodel``: the fit to the all-reduce rows, and the model on paper."""
    if results.get("allreduce"):
        print("\n== cost model: alpha-beta-gamma fitted per algorithm to its median times")
        rows = fit_measured(results["allreduce"])
        report.publish(args, results, "costmodel", rows, report.format_table(FIT_COLUMNS, rows))
    print("\n== scale on paper: the alpha-beta-gamma model at 8 and 1024 H100s "
          "(arithmetic on the presets' stated constants, not a measurement)", flush=True)
    rows = costmodel.scale_on_paper()
    report.publish(args, results, "scale_on_paper", rows, report.format_table(PAPER_COLUMNS, rows))
    return True
