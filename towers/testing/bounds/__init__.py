"""Every error bound a comparison holds two runs to, in one place.

Each bound is derived in its module's docstring from one rounding model: the unit
roundoff ``u`` of each dtype and ``γ_k = k·u / (1 − k·u)``, defined once in
:mod:`towers.allreduce.machinery.rounding` (the library's codecs and its check of a
user's algorithm bound with them too, so they live beside the all-reduce, not here)::

    rounding (u, γ_k)
       │
       ├─ sums.py        a sum of depth k: γ_k·Σ|x_i| (sum_bound); one SGD step on two
       │                 summation orders (sgd_step_bound); per variable, and two trees
       │                 over the same per-example leaves (exact_sums, leaf_bounds)
       ├─ intervals.py   interval arithmetic with rounding: the sets two runs' values lie in
       ├─ optimizers.py  a gradient error carried through an optimizer and its slots
       │                 (SGD with momentum, Adam, AdamW, Nadam, RMSprop: update_bounds)
       ├─ update.py      which of them holds one teacher-forced update, and why (resolve_bound)
       └─ noise.py       the kernels' own noise floor, measured (kernel_noise_floor)

Split into modules because together they exceed one readable module (~900 lines);
the summation bounds, which nearly every caller wants, are importable from here.

Example:
    >>> from towers.testing.bounds import gamma, sum_bound       # doctest: +SKIP
"""

from __future__ import annotations

from towers.allreduce.machinery.rounding import UNIT_ROUNDOFF, gamma, unit_roundoff
from towers.testing.bounds.sums import (
    exact_sums,
    gamma_exact,
    leaf_bounds,
    sgd_step_bound,
    sum_bound,
)

__all__ = [
    "UNIT_ROUNDOFF",
    "exact_sums",
    "gamma",
    "gamma_exact",
    "leaf_bounds",
    "sgd_step_bound",
    "sum_bound",
    "unit_roundoff",
]
