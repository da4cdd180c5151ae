"""Localhost clusters: free ports, the cluster of a launch, each task's logical devices.

``towers launch`` starts one process per task on 127.0.0.1 and tells each how many
towers to simulate through :data:`TOWERS_ENV`; the process reads it with
:func:`towers_per_task` and passes it to :func:`towers.cluster.runtime.start_worker`,
which splits the CPU before TensorFlow's runtime starts (the ``simulate_devices``
rule, per process)::

    launch --workers 2 --towers-per-worker 2
      process worker:0  TF_CONFIG task 0, TOWERS_PER_TASK=2 → CPU:0 CPU:1
      process worker:1  TF_CONFIG task 1, TOWERS_PER_TASK=2 → CPU:0 CPU:1
"""

from __future__ import annotations

import contextlib
import os
import socket

from towers.cluster.spec import Cluster
from towers.guard.arguments import non_negative_int, positive_int

__all__ = ["HOST", "TOWERS_ENV", "free_ports", "local_cluster", "towers_per_task"]

HOST = "127.0.0.1"
TOWERS_ENV = "TOWERS_PER_TASK"
"""Environment variable: how many logical devices (towers) this task simulates."""


def free_ports(n: int, host: str = HOST) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (the OS picks them).

    All sockets stay open until every port is chosen, so the ports differ; another
    process may still take one before the cluster binds it (rare; retry the launch).

    Raises:
        ValueError: ``n`` < 0.
    """
    non_negative_int("n", n)
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
    return ports


def local_cluster(workers: int, ps: int = 0, chief: bool = False) -> Cluster:
    """A cluster of ``workers`` workers (and ``ps`` parameter servers) on free local ports.

    Args:
        workers: worker tasks, at least 1.
        ps: parameter-server tasks.
        chief: add a separate ``chief`` task (otherwise worker 0 is the chief).

    Raises:
        ValueError: ``workers`` < 1 or ``ps`` < 0.

    Example:
        >>> sorted(local_cluster(2, ps=1).jobs)
        ['ps', 'worker']
    """
    positive_int("workers", workers)
    non_negative_int("ps", ps)
    ports = iter(free_ports(workers + ps + int(chief)))
    jobs: dict[str, tuple[str, ...]] = {}
    if chief:
        jobs["chief"] = (f"{HOST}:{next(ports)}",)
    jobs["worker"] = tuple(f"{HOST}:{next(ports)}" for _ in range(workers))
    if ps:
        jobs["ps"] = tuple(f"{HOST}:{next(ports)}" for _ in range(ps))
    return Cluster(jobs)


def towers_per_task(default: int = 1) -> int:
    """The tower count :data:`TOWERS_ENV` asks for (``default`` when unset).

    Raises:
        ValueError: the variable is not a positive integer.
    """
    text = os.environ.get(TOWERS_ENV)
    if text is None or text == "":
        return default
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{TOWERS_ENV} must be a positive integer, got {text!r}")
    return n

