"""Start TensorFlow's distributed runtime in this process: a worker, a server, or a client.

Two ways to train on several processes, both on TensorFlow's own gRPC runtime::

    between-graph (start_worker)           in-graph (start_server + connect)
    every task runs the same program;      tasks only serve; one client builds one
    its TowerTrainer uses local towers     graph over every task's towers
    and CrossWorker's collectives          /job:worker/replica:0/task:k/device:CPU:i
    (MultiWorkerMirroredStrategy's way)    (tf.distribute.Server + connect_to_cluster)

Order matters (measured, TF 2.21): logical devices and ``configure_collective_ops``
must precede the first op ("Collective ops must be configured at program startup"),
so :func:`start_worker` splits the CPU itself with ``set_logical_device_configuration``
(which, unlike listing devices, does not start the runtime) and then enables collective
ops with a ``ServerDef``, as MultiWorkerMirroredStrategy does. Afterwards a bare
``/device:CPU:1`` means this task's CPU:1.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.ops import collective_ops

from towers.allreduce.machinery.ordering import REWRITES
from towers.allreduce.machinery.tf_collective_ops import shared_keys
from towers.cluster.local import towers_per_task
from towers.cluster.spec import Cluster, resolve
from towers.devices import set_local_task
from towers.guard.arguments import positive_float, positive_int

__all__ = [
    "connect", "leave_together", "serve", "set_logical_devices", "start_server", "start_worker",
]


def set_logical_devices(n: int) -> None:
    """Split the host CPU into ``n`` logical devices without starting the runtime.

    Raises:
        ValueError: ``n`` < 1.
        RuntimeError: the runtime already started with another count (what to do).
    """
    n = positive_int("towers per task", n)
    cpu = tf.config.list_physical_devices("CPU")[0]
    configs = tf.config.get_logical_device_configuration(cpu)
    if configs is not None and len(configs) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError as err:
        raise RuntimeError(
            f"cannot give this task {n} towers: TensorFlow's runtime already started. Start "
            "the cluster runtime first thing in the program, before any TensorFlow op."
        ) from err


def _port(cluster: Cluster) -> int:
    assert cluster.task_type is not None and cluster.task_index is not None
    return int(cluster.jobs[cluster.task_type][cluster.task_index].rsplit(":", 1)[1])


def _need_task(cluster: Cluster, what: str) -> None:
    if cluster.task_type is None:
        raise ValueError(f"{what} needs this process's task: set TF_CONFIG's 'task' or pass it")


def start_worker(cluster: Any = None, towers: int | None = None) -> list[str]:
    """Join the cluster for between-graph training and return this task's towers.

    Splits the CPU into ``towers`` logical devices, points collective ops at the
    chief (the group leader) and starts this task's gRPC server, as
    MultiWorkerMirroredStrategy does at start-up. Call it first thing.

    Args:
        cluster: anything :func:`towers.cluster.resolve` takes (default: TF_CONFIG).
        towers: logical devices of this task (default: ``$TOWERS_PER_TASK`` or 1).

    Returns:
        This task's tower names, ``['/device:CPU:0', …]`` (local: no job prefix).

    Raises:
        ValueError: no task for this process, or a malformed cluster.
        RuntimeError: TensorFlow's runtime already started.
    """
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    found = resolve(cluster)
    _need_task(found, "start_worker")
    n = towers_per_task() if towers is None else towers
    set_logical_devices(n)
    set_local_task(str(found.task_type), int(found.task_index or 0))  # its devices: short names
    ctx = context.context()
    try:
        ctx.configure_collective_ops(
            collective_leader=found.task_name(*found.chief),
            device_filters=(found.task_name(),),  # don't wait on the other tasks' devices
        )
    except RuntimeError as err:
        raise RuntimeError(
            "start_worker came too late: TensorFlow's runtime already started. Call "
            "towers.cluster.start_worker() first thing in the program."
        ) from err
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=found.cluster_spec().as_cluster_def(),
        default_session_config=ctx.config,
        job_name=found.task_type,
        task_index=found.task_index,
        protocol="grpc",
        port=_port(found),
    )
    ctx.enable_collective_ops(server_def)
    ctx.ensure_initialized()
    return [f"/device:CPU:{i}" for i in range(n)]


def start_server(cluster: Any = None, towers: int | None = None) -> tf.distribute.Server:
    """Start this task's ``tf.distribute.Server`` with ``towers`` CPUs (in-graph mode).

    Args:
        cluster: anything :func:`towers.cluster.resolve` takes (default: TF_CONFIG).
        towers: logical devices of this task (default: ``$TOWERS_PER_TASK`` or 1).

    Returns:
        The started server (``server.join()`` serves until the process is killed).

    Raises:
        ValueError: no task for this process, or a malformed cluster.
    """
    found = resolve(cluster)
    _need_task(found, "start_server")
    n = towers_per_task() if towers is None else towers
    n = positive_int("towers per task", n)
    # The server's devices come from its own ConfigProto, not from the eager context's
    # logical-device configuration (measured: that one leaves the server with CPU:0 only).
    config = tf.compat.v1.ConfigProto(device_count={"CPU": n})
    # A remote task optimizes the graph pieces it runs with its own options: keep additions
    # as written there too (towers.allreduce.machinery.ordering.REWRITES, docs/architecture.md).
    rewrites = config.graph_options.rewrite_options
    for name in REWRITES:
        setattr(rewrites, name, rewriter_config_pb2.RewriterConfig.OFF)
    # and no AddN turned into AssignAdds summed in arrival order (ordering._keep_sums)
    rewrites.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    return tf.distribute.Server(
        found.cluster_spec(), job_name=found.task_type, task_index=found.task_index,
        protocol="grpc", config=config, start=True,
    )


def serve(cluster: Any = None, towers: int | None = None) -> None:
    """Start this task's server and serve until killed or orphaned (never returns).

    A server whose parent process dies exits too, so a client killed by a timeout
    leaves no server behind.
    """
    server = start_server(cluster, towers)
    print(f"serving {server.target}", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


_LOCAL = ("127.0.0.1", "localhost", "[::1]")


def leave_together(cluster: Any = None, limit: float = 60.0) -> bool:
    """Wait until every training task of this run has called this (or ``limit`` s passed).

    Call it after a worker's last step, before the process exits. A collective's
    receiver pulls its last buffer from the sender (gRPC ``RecvBuf``), so a worker that
    exits as soon as its own last all-reduce returns can leave a peer's last pull
    unanswered, and the peer fails with "Socket closed" (seen in CI). When every task
    is on this machine, each one marks a file in a folder named after the cluster's
    addresses (its ports are this run's own) and waits for the others' marks; this uses
    no gRPC, so no pull is left behind. Across machines it is one more all-reduce, which
    waits for every data collective before it; only the barrier's own last pull is then
    still racing the exit.

    Args:
        cluster: the cluster (anything :func:`towers.cluster.resolve` takes).
        limit: seconds to wait at most (a lost peer must not hang the exit).

    Returns:
        True when every task arrived in time.

    Raises:
        ValueError: ``limit`` is not a positive number, or this process is no task.
    """
    positive_float("limit", limit)
    found = resolve(cluster)
    _need_task(found, "leave_together")
    workers = found.num_workers
    addresses = [a for job in ("chief", "worker") for a in found.jobs.get(job, ())]
    if not all(a.rsplit(":", 1)[0] in _LOCAL for a in addresses):
        key = shared_keys(2)
        with tf.device("/device:CPU:0"):
            collective_ops.all_reduce_v2(
                tf.ones([1]), group_size=workers, group_key=key, instance_key=key + 1,
                merge_op="Add", final_op="Id", timeout=limit)
        return True
    spec = json.dumps(found.as_dict(), sort_keys=True).encode()
    folder = os.path.join(tempfile.gettempdir(),
                          f"towers-done-{hashlib.sha256(spec).hexdigest()[:16]}")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, found.task_name().replace("/", "_")), "w").close()
    deadline = time.monotonic() + limit
    while len(os.listdir(folder)) < workers:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _full(name: str) -> str:
    return str(tf.DeviceSpec.from_string(name).to_string())


def connect(cluster: Any, towers_per_task: int, job: str = "worker") -> list[str]:
    """Connect this client to a running cluster and return every task's tower names.

    Args:
        cluster: the cluster's description (anything :func:`towers.cluster.resolve` takes).
        towers_per_task: logical devices each task of ``job`` serves.
        job: the job whose tasks hold towers.

    Returns:
        ``/job:worker/replica:0/task:k/device:CPU:i`` for every task k and tower i.

    Raises:
        ValueError: the tasks do not expose those devices.
    """
    found = resolve(cluster)
    tf.config.experimental_connect_to_cluster(found.cluster_spec())
    towers = found.tower_devices(towers_per_task, job=job)
    known = {_full(d.name) for d in tf.config.list_logical_devices()}
    missing = [d for d in towers if _full(d) not in known]
    if missing:
        raise ValueError(f"the cluster does not serve {missing}; it serves {sorted(known)}")
    return towers
