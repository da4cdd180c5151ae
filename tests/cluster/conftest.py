"""Shared by the multi-process tests: launch tests/cluster/train_worker.py on 2 workers.

``run_workers`` calls :func:`towers.cluster.launch` in this process (no second
TensorFlow import for a launcher), bounded by its timeout. ``straight_run`` is one
uninterrupted run on :data:`BATCHES` that test_unequal checks against the
single-process trainer and test_faults against its interrupted-and-resumed twin.
"""

from __future__ import annotations

import io
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from towers.cluster import launch, local_cluster

SCRIPT = str(Path(__file__).with_name("train_worker.py"))
BATCHES = (61, 7, 1, 33, 64)
"""Global batches, one per step: 61 and 7 split unequally over 2 workers (and towers),
1 leaves worker 1 with no example at all."""
WORKERS, TOWERS, LR = 2, 2, 0.1


class Run(NamedTuple):
    """A launch's exit code, its prefixed output and its wall time."""

    code: int
    out: str
    seconds: float

    def lines(self, kind: str) -> dict[int, list[list[str]]]:
        """``worker -> [fields of each "<kind> …" line]`` in order."""
        found: dict[int, list[list[str]]] = {}
        for w, rest in re.findall(rf"^\[worker (\d)\] {kind} (.*)$", self.out, re.M):
            found.setdefault(int(w), []).append(rest.split())
        return found


def launch_workers(command: list[str], towers: int = TOWERS, timeout: float = 90.0,
                   grace: float = 0.0) -> Run:
    """Run ``command`` on WORKERS workers × ``towers`` (``towers launch``), bounded."""
    out = io.StringIO()
    start = time.monotonic()
    code = launch(local_cluster(WORKERS), towers, command, timeout=timeout, out=out,
                  failure_grace=grace)
    return Run(code, out.getvalue(), time.monotonic() - start)


def run_workers(*args: str, timeout: float = 90.0, grace: float = 0.0) -> Run:
    """Launch ``train_worker.py ARGS`` on WORKERS × TOWERS; at most ``timeout`` s."""
    return launch_workers([sys.executable, SCRIPT, *args], timeout=timeout, grace=grace)


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """One uninterrupted run over BATCHES (weights of every step in the returned dir)."""
    out = tmp_path_factory.mktemp("straight")
    run = run_workers("--batches", ",".join(map(str, BATCHES)), "--lr", str(LR),
                      "--out", str(out))
    assert run.code == 0, run.out[-4000:]
    return run, out
