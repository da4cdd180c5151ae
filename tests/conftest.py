"""Test session set-up: 8 logical CPU devices before TensorFlow starts, Hypothesis profiles.

TensorFlow fixes its device list when its runtime starts, so this runs before any
test module touches TensorFlow. Tests use a prefix of these devices
(``DEVICES[:n]``). Profiles: ``ci`` (default; few examples, derandomized, no
deadline) and ``thorough`` (select with ``--hypothesis-profile=thorough``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hypothesis import HealthCheck, Phase, settings

import towers

MAX_TOWERS = 8
DEVICES = towers.simulate_devices(MAX_TOWERS)

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile(
    "ci",
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=_SLOW,
    print_blob=True,
    database=None,
    # A training example costs seconds: shrinking one in CI could take many minutes. The
    # failing example is still printed; rerun with the thorough profile to shrink it.
    phases=[Phase.explicit, Phase.generate],
)
settings.register_profile(
    "thorough", max_examples=60, deadline=None, suppress_health_check=_SLOW, print_blob=True
)


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption(
        "--profile",
        default=os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        choices=["ci", "thorough"],
        help="Hypothesis profile (default ci)",
    )


def pytest_configure(config):  # type: ignore[no-untyped-def]
    settings.load_profile(config.getoption("--profile"))
