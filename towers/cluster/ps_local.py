"""A local cluster of worker and ps servers for one client, and the client's devices in it.

::

    with local_ps_cluster(workers=2, ps=1, towers_per_worker=2) as local:
        worker 0  python -m towers.cluster.server   CPU:0 CPU:1     ─┐
        worker 1  python -m towers.cluster.server   CPU:0 CPU:1      ├─ this process: the client
        ps 0      python -m towers.cluster.server   CPU:0           ─┘
        workers, ps_devices = connect_ps(local.cluster, 2)

Every server is its own process group and exits with its parent; leaving the block
stops them all (``local.stop("ps", 0)`` stops one early, to test a lost ps).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

from towers.cluster.launcher import SERVER_COMMAND, ServingWatch, TaskProcess
from towers.cluster.local import local_cluster
from towers.cluster.runtime import connect
from towers.cluster.spec import Cluster
from towers.guard.arguments import positive_int

__all__ = ["LocalPSCluster", "connect_ps", "local_ps_cluster"]


class LocalPSCluster:
    """The running servers: ``cluster`` and each task's process."""

    def __init__(self, cluster: Cluster, tasks: dict[tuple[str, int], TaskProcess]) -> None:
        self.cluster, self.tasks = cluster, tasks

    def stop(self, job: str, index: int) -> None:
        """Stop one task's server now (the others keep serving)."""
        self.tasks[(job, index)].stop()


@contextlib.contextmanager
def local_ps_cluster(workers: int, ps: int, towers_per_worker: int, *,
                     chief: bool = False, ready_timeout: float = 60.0,
                     out: IO[str] | None = None) -> Iterator[LocalPSCluster]:
    """Serve ``workers`` worker and ``ps`` parameter-server tasks on localhost while in the block.

    ``chief=True`` adds a ``chief`` address for the client itself (not started), as
    ``ParameterServerStrategy``'s client needs (its coordinator is task chief 0).

    Raises:
        ValueError: fewer than 1 worker or 1 ps.
        RuntimeError: a server exited or did not start within ``ready_timeout``.
    """
    positive_int("ps", ps)
    cluster = local_cluster(workers, ps=ps, chief=chief)
    lock = threading.Lock()
    tasks, watches = {}, []
    try:
        for job, count, towers in (("worker", workers, towers_per_worker), ("ps", ps, 1)):
            for k in range(count):
                watches.append(ServingWatch(out or sys.stderr))
                tasks[(job, k)] = TaskProcess(cluster, job, k, towers, SERVER_COMMAND,
                                              watches[-1], lock)
        deadline = time.monotonic() + ready_timeout
        while not all(w.ready for w in watches):
            if any(t.poll() is not None for t in tasks.values()) or time.monotonic() > deadline:
                raise RuntimeError(f"the local servers ({workers} workers, {ps} ps) did not "
                                   f"start within {ready_timeout:g} s")
            time.sleep(0.05)
        yield LocalPSCluster(cluster, tasks)
    finally:
        for task in tasks.values():
            task.stop()
        for task in tasks.values():
            task.finish()


def connect_ps(cluster: Cluster, towers_per_worker: int) -> tuple[list[list[str]], list[str]]:
    """Connect this client; return each worker's towers and the ps devices.

    Raises:
        ValueError: the cluster has no ps job, or does not serve the towers.
    """
    if "ps" not in cluster.jobs:
        raise ValueError(f"the cluster has no 'ps' job: {sorted(cluster.jobs)}")
    towers = connect(cluster, towers_per_worker)
    workers = [towers[k:k + towers_per_worker] for k in range(0, len(towers),
                                                               towers_per_worker)]
    ps = [f"{cluster.task_name('ps', k)}/device:CPU:0" for k in range(len(cluster.jobs["ps"]))]
    return workers, ps
