"""The pytest plugin: the fixture ``steps_match``, :func:`towers.testing.assert_steps_match`.

Load it from a conftest, ``pytest_plugins = ["towers.testing.plugin"]`` (not an entry
point: importing :mod:`towers.testing` never imports pytest); then::

    def test_my_step(steps_match):
        steps_match(towers_step, my_step, batches)   # AssertionError: the first divergence
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from towers.testing.compare import assert_steps_match
from towers.testing.report import BisectReport

__all__ = ["steps_match"]


@pytest.fixture
def steps_match() -> Callable[..., BisectReport]:
    """:func:`~towers.testing.assert_steps_match`, as a fixture."""
    return assert_steps_match
