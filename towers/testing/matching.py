"""A user's equivalence test in a few lines: a batch strategy and one assertion.

::

    from hypothesis import given
    from towers.testing import assert_steps_match, step_cases

    @given(step_cases(features=64, classes=10))
    def test_my_step_matches_towers(case):
        n, batches = case
        assert_steps_match(towers_step(n), my_step(n), batches)   # prints the first divergence

``step_cases`` draws a tower count and a few ``(x, y)`` batches whose sizes include
the awkward ones: fewer examples than towers (empty towers) and uneven splits. The
pytest fixture of the same assertion is :mod:`towers.testing.plugin`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from hypothesis import strategies as st

from towers.guard.arguments import positive_int
from towers.testing.compare import compare
from towers.testing.report import BisectReport

__all__ = ["assert_steps_match", "step_batches", "step_cases"]


Batches = list[tuple[np.ndarray, np.ndarray]]


def step_batches(features: int, classes: int, *, steps: int = 2,
                 max_batch: int = 12) -> st.SearchStrategy[Batches]:  # fmt: skip
    """Hypothesis: ``steps`` batches ``(x [b, features] float32 in [-1, 1], y [b] int32)``.

    Sizes are drawn from 1..``max_batch`` (so some split unevenly over the towers and
    some leave towers empty); values from a drawn seed (fast to generate and to shrink).

    Raises:
        ValueError: ``features``, ``classes``, ``steps`` or ``max_batch`` not an int >= 1.
    """
    for name, value in (("features", features), ("classes", classes), ("steps", steps),
                        ("max_batch", max_batch)):  # fmt: skip
        positive_int(name, value)

    def make(sizes: list[int], seed: int) -> Batches:
        rng = np.random.default_rng(seed)
        return [(rng.uniform(-1, 1, (b, features)).astype("float32"),
                 rng.integers(0, classes, b).astype("int32")) for b in sizes]  # fmt: skip

    sizes = st.lists(st.integers(1, max_batch), min_size=steps, max_size=steps)
    return st.builds(make, sizes, st.integers(0, 2**31 - 1))


def step_cases(features: int, classes: int, *, max_towers: int = 4, steps: int = 2,
               max_batch: int = 12) -> st.SearchStrategy[tuple[int, list[Any]]]:  # fmt: skip
    """Hypothesis: ``(towers, batches)``: a tower count in 1..``max_towers`` and
    :func:`step_batches`.

    Raises:
        ValueError: ``max_towers`` (or a :func:`step_batches` argument) not an int >= 1.
    """
    positive_int("max_towers", max_towers)
    batches = step_batches(features, classes, steps=steps, max_batch=max_batch)
    return st.tuples(st.integers(1, max_towers), batches)


def assert_steps_match(a: Any, b: Any, batches: Iterable[Any], **options: Any) -> BisectReport:
    """Assert step ``b`` matches step ``a`` on every batch (``towers.testing.compare``).

    Args:
        a: the reference step (the teacher: ``b`` is set to its weights before each step).
        b: the step under test.
        batches: ``(x, y)`` global batches.
        **options: ``compare``'s keywords (``bound``, ``loss``, ``towers``, ``steps``).

    Returns:
        The report (every step within its bound).

    Raises:
        AssertionError: a step left the bound; the message is the report, with the first
            divergence's step, variable, element, both values, |Δ|, the bound used and the
            causes the batches and the two sides show (:mod:`towers.testing.causes`).
    """
    report = compare(a, b, batches, **options)
    if not report.ok:
        raise AssertionError(f"the steps differ\n{report}")
    return report
