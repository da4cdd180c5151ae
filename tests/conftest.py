"""Test session set-up: 8 logical CPU devices before TensorFlow starts, Hypothesis profiles.

Devices. TensorFlow fixes its device list when its runtime starts, so this runs
before any test module touches TensorFlow. The host CPU is split into
``MAX_TOWERS`` logical CPUs, ``DEVICES``; tests use a prefix of them
(``DEVICES[:n]``). Real GPUs are left whole (``simulate_devices(kind="cpu")``):
the CPU suite runs on the same logical CPUs on every machine, and GPU tests
(``GPUS``, e.g. the raw-NCCL test in ``tests/allreduce/test_nccl.py``) run on the
machine's real GPUs, one NCCL rank per physical GPU, and skip with their reason
where there are none.

Hypothesis profiles (select with ``--profile thorough``, or ``HYPOTHESIS_PROFILE``):

========  ===================================================  =============================
profile   examples per property test                           other settings
========  ===================================================  =============================
ci        8, or ``examples(ci=k)`` = k where a test asks        derandomized, no shrinking,
          for fewer (each example trains two models, seconds)   no database, no deadline
thorough  ``THOROUGH_FACTOR`` (8) × the ci count: 64, or 8·k    random, shrinks, no deadline
========  ===================================================  =============================

Explicit ``@example`` cases run in addition, in both profiles. A property test sets
its count with ``@settings(max_examples=examples(ci=k))`` and never pins a raw number,
so ``thorough`` really runs more everywhere.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
from hypothesis import HealthCheck, Phase, settings

import towers

MAX_TOWERS = 8
DEVICES = towers.simulate_devices(MAX_TOWERS, kind="cpu")

import tensorflow as tf  # noqa: E402  (after the devices are configured)

GPUS = [d.name for d in tf.config.list_logical_devices("GPU")]
"""The machine's real GPUs (never split here), for the GPU-only tests; often empty."""

CI_EXAMPLES = 8
THOROUGH_FACTOR = 8
_FACTOR = {"ci": 1, "thorough": THOROUGH_FACTOR}
_profile = ["ci"]

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile(
    "ci",
    max_examples=CI_EXAMPLES,
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
    "thorough",
    max_examples=CI_EXAMPLES * THOROUGH_FACTOR,
    deadline=None,
    suppress_health_check=_SLOW,
    print_blob=True,
)


def examples(ci: int) -> int:
    """The number of generated examples for a test that runs ``ci`` under the ci profile.

    ``ci`` under ``ci``, ``THOROUGH_FACTOR·ci`` under ``thorough``: use it as
    ``@settings(max_examples=examples(ci=4))`` (or pass it as ``max_examples`` to
    ``check_all_reduce``). Read when the test module is imported, after the profile
    is loaded.
    """
    if isinstance(ci, bool) or not isinstance(ci, int) or ci < 1:
        raise ValueError(f"ci must be a positive int, got {ci!r}")
    return ci * _FACTOR[_profile[0]]


def profile() -> str:
    """The name of the loaded Hypothesis profile ("ci" or "thorough")."""
    return _profile[0]


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption(
        "--profile",
        default=os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        choices=sorted(_FACTOR),
        help="Hypothesis profile: ci (default, 8 examples per test) or thorough (8x more)",
    )


def pytest_configure(config):  # type: ignore[no-untyped-def]
    _profile[0] = config.getoption("--profile")
    settings.load_profile(_profile[0])


def pytest_runtest_logreport(report):  # type: ignore[no-untyped-def]
    """With ``TOWERS_TEST_TIMES=FILE``, append each test phase's time and outcome to FILE as
    it ends (one tab-separated line): the times survive a run that is cut short, and
    choosing what is a ``long`` proof reads them."""
    path = os.environ.get("TOWERS_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t{report.outcome}\n")


USER_STAR = '''\
import tensorflow as tf

from towers.allreduce import Algorithm, check_values, combine, finish, register, send


def star(values, *, op="sum"):
    """Everyone sends to the last tower, which adds in tower order and sends back; no ticks."""
    devices = check_values(values, op)
    hub = devices[-1]
    with tf.device(hub):
        total = send(values[0], hub)
        for v in values[1:]:
            total = combine(total, send(v, hub), op)
        total = finish(total, op, len(values))
    return [send(total, d) for d in devices]


def make_star():
    return star


def star_d(values, *, op="sum"):
    """The star with a registry record beside it (bytes and depth for the tools)."""
    return star(values, op=op)


register(Algorithm(
    "star_d", lambda: star_d,
    bytes_sent=lambda n, nbytes, itemsize: [nbytes] * (n - 1) + [(n - 1) * nbytes],
    summation_depth=lambda n: n - 1,
))

SHOUT = "not an algorithm"
'''
"""A user's algorithm module, as a user writes ``my_algos.py``: ``star`` (no ticks),
``make_star`` (a factory), ``star_d`` (registered) and ``SHOUT`` (not an algorithm)."""


@pytest.fixture
def user_module(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """``user_star.py`` (:data:`USER_STAR`) in the test's current folder, importable as
    ``user_star``; its module and registry record are removed afterwards."""
    import sys

    from towers.allreduce import ALGORITHMS

    (tmp_path / "user_star.py").write_text(USER_STAR)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_star", raising=False)
    yield "user_star"
    sys.modules.pop("user_star", None)
    ALGORITHMS.pop("star_d", None)


def replica_bytes(trainer: Any) -> list[bytes]:
    """Every replica's model and optimizer variables as bytes: compare two snapshots to
    prove a step (or a refused call) changed nothing, bit for bit."""
    return [
        np.asarray(v.numpy()).tobytes()
        for r in trainer.replicas
        for v in [*r.model.variables, *r.optimizer.variables]
    ]


def collective_threads() -> int:
    """Threads of TensorFlow's collective executor in this process (Linux's /proc).

    Its pool only grows to the most collectives ever blocked at once; a collective op
    with its own ``timeout=`` adds one thread that sleeps the whole timeout.
    """
    tasks = Path("/proc/self/task")
    names = []
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):  # a thread that ended while listed
            names.append((task / "comm").read_text().strip())
    return names.count("collective_ops")


HAS_PROC = Path("/proc/self/task").is_dir()
