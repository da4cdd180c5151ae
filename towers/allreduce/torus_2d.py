"""2D-torus all-reduce: reduce-scatter along rows, all-reduce along columns, all-gather along rows.

n = 4 towers as a 2×2 grid (tower ``t = i·C + q``: row i, column q), chunks c0..c3 (part
q of the buffer is chunks ``q·R .. q·R+R−1``), ``+▶t`` reduces into t, ``▶t`` copies::

    tick           0 │       1       2 │       3
              row RS │   column ring   │  row AG (copy)
    tower 0  c2c3+▶1 │   c1+▶2   c0 ▶2 │  c0c1 ▶1
    tower 1  c0c1+▶0 │   c3+▶3   c2 ▶3 │  c2c3 ▶0
    tower 2  c2c3+▶3 │   c0+▶0   c1 ▶0 │  c0c1 ▶3
    tower 3  c0c1+▶2 │   c2+▶1   c3 ▶1 │  c2c3 ▶2

Index formula (R rows × C columns, n chunks): (1) row reduce-scatter: at tick s column q
reduces part ``(q − s − 1) mod C`` into column ``q + 1`` (C − 1 ticks). (2) Column ring
over part q: at tick s row i reduces chunk ``q·R + (i − s − 1) mod R`` into row ``i + 1``
(R − 1 ticks), then copies chunk ``q·R + (i − s) mod R`` to it (R − 1 ticks). (3) Row
all-gather: at tick s column q copies part ``(q − s) mod C`` to column ``q + 1``.

The grid is :func:`grid`'s (a prime n degenerates to the ring). Cost (S bytes):
``(2(C−1) + 2(R−1))·α + 2(n−1)/n·S·β + (n−1)/n·S·γ``, the ring's bytes in fewer
ticks; summation depth ``(C−1) + (R−1)``.

References:
    H. Mikami, H. Suganuma, P. U-chupala, Y. Tanaka, Y. Kageyama, "Massively
    Distributed SGD: ImageNet/ResNet-50 Training in a Flash", arXiv:1811.05233,
    2018.
"""

from __future__ import annotations

import functools
import math

from towers.allreduce.machinery.registry import Coefficients, register_schedule
from towers.guard.arguments import positive_int
from towers.schedule.ir import Schedule, Step

__all__ = ["cost", "grid", "torus_2d", "torus_2d_schedule"]


def grid(n: int, rows: int | None = None) -> tuple[int, int]:
    """``(R, C)`` for ``n`` towers: R = ``rows``, else the largest divisor of n <= √n.

    Raises:
        ValueError: ``n`` or ``rows`` is not an int >= 1, or ``rows`` does not divide n.
    """
    n = positive_int("n", n)
    if rows is None:
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    rows = positive_int("rows", rows)
    if n % rows:
        raise ValueError(f"rows={rows} must divide the tower count n={n}")
    return rows, n // rows


def _row_ticks(rows: int, cols: int, kind: str) -> list[tuple[Step, ...]]:
    """Phase 1 (``reduce``) or 3 (``copy``): rings along every row, a part of R chunks a tick."""
    lag = 1 if kind == "reduce" else 0
    return [tuple(Step(i * cols + q, i * cols + (q + 1) % cols, ((q - s - lag) % cols) * rows + k,
                       kind)
                  for i in range(rows) for q in range(cols) for k in range(rows))
            for s in range(cols - 1)]


@functools.lru_cache(maxsize=256)
def torus_2d_schedule(n: int, rows: int | None = None) -> Schedule:
    """The 2D-torus all-reduce over ``n`` towers on an R×C grid (``rows``: see :func:`grid`)."""
    r, c = grid(n, rows)
    columns = [tuple(Step(i * c + q, ((i + 1) % r) * c + q, q * r + (i - s - lag) % r, kind)
                     for q in range(c) for i in range(r))  # phase 2: a ring down every column
               for kind, lag in (("reduce", 1), ("copy", 0)) for s in range(r - 1)]
    ticks = _row_ticks(r, c, "reduce") + columns + _row_ticks(r, c, "copy")
    return Schedule("torus_2d", n, n, tuple(ticks))


def cost(n: int, nbytes: float, rows: int | None = None) -> Coefficients:
    """α-β-γ coefficients (the module's formula)."""
    r, c = grid(n, rows)
    return 2 * (c - 1) + 2 * (r - 1), 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes


torus_2d = register_schedule("torus_2d", torus_2d_schedule, cost, __doc__)
