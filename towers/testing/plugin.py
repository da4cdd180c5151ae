"""The pytest plugin: `pytest_plugins = ["towers.testing.plugin"]` gives `steps_match`."""

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
