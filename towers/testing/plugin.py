"""The pytest plugin: the fixture ``steps_match``, ``towers.testing.assert_steps_match``.

Load it from a conftest, ``pytest_plugins = ["towers.testing.plugin"]``; then::

    def test_my_step(steps_match):
        steps_match(towers_step, my_step, batches)   # AssertionError: the first divergence

It is not registered as a ``pytest11`` entry point: the project's own test run (and a
user's) loads it only when asked, and importing :mod:`towers.testing` never imports
pytest.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from towers.testing.matching import assert_steps_match
from towers.testing.report import BisectReport

__all__ = ["steps_match"]


@pytest.fixture
def steps_match() -> Callable[..., BisectReport]:
    """:func:`~towers.testing.matching.assert_steps_match`, as a fixture."""
    return assert_steps_match
