"""Fit the α-β-γ cost model to measured rows, and check its predictions.

:func:`fit` estimates a :class:`~towers.bench.costmodel.Link` by non-negative least
squares on relative error; :func:`compare` sets predicted against measured time per
row; :func:`format_table` prints that. The formulas are
:func:`towers.bench.costmodel.coefficients`: every time is ``a·α + b·β + c·γ``.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal, overload

import numpy as np

from towers.bench.costmodel import model as costmodel
from towers.bench.costmodel.model import Link
from towers.guard.arguments import check_choice

__all__ = ["SPLITS", "compare", "fit", "format_table", "holdout", "split_sizes"]

_CALIBRATION = ("send", "add")
"""Not all-reduces: rows that join every per-algorithm fit (they split β from γ)."""


def _row(row: Any) -> tuple[str, int, float, float, dict[str, Any]]:
    def get(key: str, default: Any = None) -> Any:
        return row.get(key, default) if isinstance(row, Mapping) else getattr(row, key, default)

    algorithm, n, nbytes, seconds = (get(k) for k in ("algorithm", "n", "nbytes", "seconds"))
    if algorithm is None or n is None or nbytes is None or seconds is None:
        raise ValueError(f"rows need algorithm, n, nbytes and seconds; got {row!r}")
    costmodel.algbw(nbytes, seconds)  # validates both
    return algorithm, n, nbytes, seconds, dict(get("params") or {})


def _nnls_small(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns: try every support set."""
    best, best_x = math.inf, np.zeros(a.shape[1])
    for support in itertools.product((False, True), repeat=a.shape[1]):
        x = np.zeros(a.shape[1])
        if any(support):
            x[list(support)] = np.linalg.lstsq(a[:, list(support)], b, rcond=None)[0]
        residual = float(np.linalg.norm(a @ x - b))
        if x.min() >= 0 and residual < best * (1 - 1e-12):
            best, best_x = residual, x
    return best_x


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    try:
        from scipy.optimize import nnls
    except ImportError:
        return _nnls_small(a, b)
    return np.asarray(nnls(a, b)[0])


def _fit_link(rows: list[tuple[str, int, float, float, dict[str, Any]]], name: str) -> Link:
    if not rows:
        raise ValueError("rows is empty: nothing to fit")
    a = np.array([costmodel.coefficients(alg, n, s, **p) for alg, n, s, _, p in rows], dtype=float)
    t = np.array([row[3] for row in rows])
    a, t = a / t[:, None], np.ones_like(t)  # minimize relative error: small rows count too
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    if np.linalg.matrix_rank(a / scale) < 3:
        warnings.warn(
            f"fit {name!r}: the rows do not determine α, β and γ separately (ring-like "
            "all-reduces fix only 2β + γ): add 'send' and 'add' rows; one of many solutions "
            "is returned",
            stacklevel=3,
        )
    alpha, beta, gamma = (float(v) for v in _nnls(a / scale, t) / scale)
    return Link(alpha=alpha, beta=beta, gamma=gamma, name=name)


@overload
def fit(rows: Sequence[Any], *, per_algorithm: Literal[False] = ..., name: str = ...) -> Link: ...


@overload
def fit(
    rows: Sequence[Any], *, per_algorithm: Literal[True], name: str = ...
) -> dict[str, Link]: ...


def fit(
    rows: Sequence[Any], *, per_algorithm: bool = False, name: str = "fit"
) -> Link | dict[str, Link]:
    """Estimate α, β, γ from measured rows by non-negative least squares on relative error.

    Args:
        rows: mappings (or objects) with ``algorithm``, ``n``, ``nbytes``, ``seconds`` and
            optional ``params``.
        per_algorithm: one :class:`Link` per algorithm; ``send``/``add`` rows join every fit.
        name: the fitted link's name (per algorithm: ``"name:algorithm"``).

    Returns:
        A :class:`Link`, or ``dict[str, Link]`` with ``per_algorithm``.

    Raises:
        ValueError: no rows, or a bad row (naming the field).

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
    """Predicted against measured time per row, with ``rel_error = predicted/measured - 1``.

    Raises:
        ValueError: a row whose algorithm has no link in a ``dict`` of links.
    """
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


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """:func:`compare`'s rows as an aligned text table (times in µs, error in %)."""
    head = ("algorithm", "n", "bytes", "measured µs", "predicted µs", "error %")
    body = [(r["algorithm"], str(r["n"]), f"{r['nbytes']:.4g}", f"{r['measured'] * 1e6:.1f}",
             f"{r['predicted'] * 1e6:.1f}", f"{r['rel_error'] * 100:+.1f}") for r in results]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))) for row in [head, *body]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


SPLITS = ("interleaved", "extrapolated")
"""How :func:`split_sizes` picks the training sizes."""


def split_sizes(
    sizes: Iterable[float], how: str = "interleaved"
) -> tuple[list[float], list[float]]:
    """``(train, held_out)``: which message sizes to fit on and which to predict.

    Args:
        sizes: the measured sizes (repeats are fine).
        how: ``"interleaved"``: every other size from the smallest trains, so each
            held-out size lies between two training sizes (the largest, with an even
            count, just beyond). ``"extrapolated"``: the smaller half (rounded up)
            trains and the larger half is predicted, as a simulation predicts sizes
            and tower counts never measured.

    Raises:
        ValueError: an unknown ``how``.

    Example:
        >>> split_sizes([1, 2, 3, 4, 5])
        ([1, 3, 5], [2, 4])
        >>> split_sizes([1, 2, 3, 4, 5], "extrapolated")
        ([1, 2, 3], [4, 5])
    """
    ordered = sorted(set(sizes))
    if check_choice("how", how, SPLITS) == "interleaved":
        return ordered[::2], ordered[1::2]
    half = (len(ordered) + 1) // 2
    return ordered[:half], ordered[half:]


def holdout(
    rows: Sequence[Any], train_sizes: Collection[float], *, name: str = "holdout"
) -> list[dict[str, Any]]:
    """Fit per algorithm on the rows at ``train_sizes`` only, and predict every row.

    Args:
        rows: as for :func:`fit` (``send``/``add`` rows at training sizes join every fit).
        train_sizes: the ``nbytes`` values to fit on; the other rows are held out.
        name: as for :func:`fit`.

    Returns:
        :func:`compare`'s rows (calibration rows left out), each with ``train``: whether
        the fit saw it. The held-out rows' ``rel_error`` is a prediction's error.

    Raises:
        ValueError: as :func:`fit`; an algorithm with no row at a training size.

    Example:
        >>> rows = [{"algorithm": "ring", "n": 4, "nbytes": s, "seconds": 1e-5 + s * 1e-9}
        ...         for s in (1e3, 1e4, 1e5)]
        >>> [(r["train"], round(r["rel_error"], 6)) for r in holdout(rows, {1e3, 1e5})]
        [(True, 0.0), (False, 0.0), (True, 0.0)]
    """
    parsed = [_row(r) for r in rows]
    trained = {alg for alg, _, s, _, _ in parsed if s in train_sizes} - set(_CALIBRATION)
    missing = sorted({alg for alg, *_ in parsed} - trained - set(_CALIBRATION))
    if missing:
        raise ValueError(f"no row at a training size for {', '.join(missing)}")
    links = fit([r for r, p in zip(rows, parsed, strict=True) if p[2] in train_sizes],
                per_algorithm=True, name=name)
    modelled = [r for r, p in zip(rows, parsed, strict=True) if p[0] not in _CALIBRATION]
    return [{**c, "train": c["nbytes"] in train_sizes} for c in compare(modelled, links)]
