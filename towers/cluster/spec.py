"""Which cluster this process belongs to: jobs of ``host:port`` addresses, this task, the chief.

:func:`resolve` turns TF_CONFIG, a ``tf.train.ClusterSpec``, a dict or a ``ClusterResolver``
into one frozen :class:`Cluster`. Nothing here starts TensorFlow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from towers.guard.arguments import non_negative_int, positive_int

__all__ = ["HOST", "TOWERS_ENV", "Cluster", "free_ports", "local_cluster", "resolve", "tf_config",
           "towers_per_task"]

HOST = "127.0.0.1"
TOWERS_ENV = "TOWERS_PER_TASK"  # how many logical devices (towers) this task simulates


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Job name -> task addresses, and this process's task (``None``: a client outside)."""

    jobs: Mapping[str, tuple[str, ...]]
    task_type: str | None = None
    task_index: int | None = None

    def __post_init__(self) -> None:
        _check_jobs(self.jobs, "cluster")
        _check_task(self.jobs, self.task_type, self.task_index)

    @property
    def chief(self) -> tuple[str, int]:
        """``(job, index)`` of the chief: ``("chief", 0)`` if that job exists, else worker 0."""
        if "chief" in self.jobs:
            return "chief", 0
        if "worker" in self.jobs:
            return "worker", 0
        raise ValueError(f"cluster has no 'chief' or 'worker' job: {sorted(self.jobs)}")

    @property
    def is_chief(self) -> bool:
        return (self.task_type, self.task_index) == self.chief

    @property
    def num_workers(self) -> int:
        """Tasks that train (chief + workers), as MultiWorkerMirroredStrategy counts them."""
        return len(self.jobs.get("chief", ())) + len(self.jobs.get("worker", ()))

    def task_name(self, job: str | None = None, index: int | None = None) -> str:
        """``/job:worker/replica:0/task:1`` for a task (default: this process's)."""
        job = self.task_type if job is None else job
        index = self.task_index if index is None else index
        if job is None or index is None:
            raise ValueError("this process has no task (a client): pass job= and index=")
        _check_task(self.jobs, job, index)
        return f"/job:{job}/replica:0/task:{index}"

    def tower_devices(self, towers_per_task: int, job: str = "worker") -> list[str]:
        """Every tower of ``job``: task 0's CPUs 0…T-1, then task 1's, …"""
        positive_int("towers_per_task", towers_per_task)
        if job not in self.jobs:
            raise ValueError(f"job {job!r} is not in the cluster; jobs: {sorted(self.jobs)}")
        return [f"{self.task_name(job, k)}/device:CPU:{i}"
                for k in range(len(self.jobs[job])) for i in range(towers_per_task)]

    def as_dict(self) -> dict[str, list[str]]:
        """The cluster as ``{job: [addresses]}`` (TF_CONFIG's ``cluster``)."""
        return {job: list(addresses) for job, addresses in self.jobs.items()}

    def cluster_spec(self) -> Any:
        import tensorflow as tf

        return tf.train.ClusterSpec(self.as_dict())


def _check_jobs(jobs: Any, argument: str) -> None:
    if not isinstance(jobs, Mapping) or not jobs:
        raise ValueError(f"{argument} must map job names to address lists, got {jobs!r}")
    for job, addresses in jobs.items():
        if not isinstance(job, str) or not job:
            raise ValueError(f"{argument}: job names must be non-empty strings, got {job!r}")
        if isinstance(addresses, str) or not isinstance(addresses, Sequence) or not addresses:
            raise ValueError(f"{argument}[{job!r}] must be a non-empty list of 'host:port' "
                             f"strings, got {addresses!r}")
        for address in addresses:
            if not isinstance(address, str) or ":" not in address:
                raise ValueError(f"{argument}[{job!r}]: {address!r} is not 'host:port'")


def _check_task(jobs: Mapping[str, Sequence[str]], job: str | None, index: int | None) -> None:
    if job is None and index is None:
        return
    if job is None or index is None:
        raise ValueError(f"task needs both a type and an index, got type={job!r} index={index!r}")
    if job not in jobs:
        raise ValueError(f"task type {job!r} is not a job of the cluster; jobs: "
                         f"{', '.join(sorted(jobs))}")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"task index must be an int, got {index!r}")
    if not 0 <= index < len(jobs[job]):
        raise ValueError(f"task index {index} is out of range: job {job!r} has "
                         f"{len(jobs[job])} task(s)")


def _from_tf_config(config: Any, argument: str) -> Cluster:
    """A TF_CONFIG (JSON text or its dict) as a ``Cluster``, every problem named."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as err:
            raise ValueError(f"{argument} is not valid JSON: {err}") from err
    if not isinstance(config, Mapping):
        raise ValueError(f"{argument} must be a JSON object, got {type(config).__name__}")
    if "cluster" not in config:
        raise ValueError(f"{argument} has no 'cluster': {dict(config)}")
    _check_jobs(config["cluster"], f"{argument}['cluster']")
    task = config.get("task") or {}
    if not isinstance(task, dict):
        raise ValueError(f"{argument}['task'] must be an object, got {task!r}")
    jobs = {job: tuple(a) for job, a in config["cluster"].items()}
    try:
        return Cluster(jobs, task.get("type"), task.get("index", 0 if "type" in task else None))
    except ValueError as err:
        raise ValueError(f"{argument}['task']: {err}") from err


def resolve(cluster: Any = None, task_type: str | None = None,
            task_index: int | None = None) -> Cluster:
    """The cluster and this process's task from ``cluster``: ``None`` (``TF_CONFIG``), a
    TF_CONFIG string or dict, a ``{job: [addresses]}`` dict, a ``ClusterSpec``, a
    ``ClusterResolver`` or a ``Cluster``; ``task_type``/``task_index`` override its task."""
    if cluster is None:
        text = os.environ.get("TF_CONFIG")
        if not text:
            raise ValueError("TF_CONFIG is not set: pass cluster= or run under `towers launch`")
        cluster = _from_tf_config(text, "TF_CONFIG")
    elif isinstance(cluster, str) or (isinstance(cluster, Mapping)
                                      and ("cluster" in cluster or "task" in cluster)):
        cluster = _from_tf_config(cluster, "cluster")
    elif isinstance(cluster, Mapping):
        _check_jobs(cluster, "cluster")
        cluster = Cluster({job: tuple(a) for job, a in cluster.items()})
    elif not isinstance(cluster, Cluster):
        cluster = _from_tensorflow(cluster)
    job = task_type if task_type is not None else cluster.task_type
    index = task_index if task_index is not None else cluster.task_index
    return Cluster(cluster.jobs, job, 0 if job is not None and index is None else index)


def _from_tensorflow(cluster: Any) -> Cluster:
    import tensorflow as tf

    spec, job, index = cluster, None, None
    if isinstance(cluster, tf.distribute.cluster_resolver.ClusterResolver):
        spec, job, index = cluster.cluster_spec(), cluster.task_type, cluster.task_id
    elif not isinstance(cluster, tf.train.ClusterSpec):
        raise TypeError("cluster must be None (TF_CONFIG), a TF_CONFIG string or dict, a {job: "
                        "[addresses]} dict, a tf.train.ClusterSpec or a ClusterResolver; got "
                        f"{type(cluster).__name__}")
    jobs = {}
    for name in spec.jobs:
        tasks = spec.job_tasks(name)  # a sparse job lists None for missing indices
        if any(t is None for t in tasks):
            raise ValueError(f"cluster: job {name!r} has missing task indices: {tasks}")
        jobs[name] = tuple(tasks)
    return Cluster(jobs, job, index)


def tf_config(cluster: Cluster, job: str, index: int) -> str:
    """The TF_CONFIG JSON that puts a process at task ``index`` of ``job``."""
    Cluster(cluster.jobs, job, index)  # the task is checked
    return json.dumps({"cluster": cluster.as_dict(), "task": {"type": job, "index": index}})


def free_ports(n: int, host: str = HOST) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now (another process may still take one)."""
    non_negative_int("n", n)
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
    return ports


def local_cluster(workers: int, ps: int = 0, chief: bool = False) -> Cluster:
    """``workers`` workers, ``ps`` parameter servers (and a ``chief`` task) on free local ports."""
    positive_int("workers", workers)
    non_negative_int("ps", ps)
    ports = iter(free_ports(workers + ps + int(chief)))
    tasks = {"chief": int(chief), "worker": workers, "ps": ps}  # in the ports' order
    return Cluster({job: tuple(f"{HOST}:{next(ports)}" for _ in range(n))
                    for job, n in tasks.items() if n})


def towers_per_task(default: int = 1) -> int:
    """The tower count :data:`TOWERS_ENV` asks for (``default`` when unset)."""
    text = os.environ.get(TOWERS_ENV, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{TOWERS_ENV} must be a positive integer, got {text!r}")
    return int(text)

