"""Start TensorFlow's gRPC runtime in this process: a worker (between-graph, as MWMS), a
server or a client (in-graph). Call these first thing, before any TensorFlow op.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2, tensorflow_server_pb2
from tensorflow.python.eager import context
from tensorflow.python.ops import collective_ops

from towers.allreduce.machinery.base import REWRITES
from towers.allreduce.machinery.tf_collective_ops import shared_keys
from towers.cluster.launcher import poll_until
from towers.cluster.spec import Cluster, resolve, towers_per_task
from towers.devices import set_local_task
from towers.guard.arguments import positive_float, positive_int
from towers.guard.deadline import watched
from towers.guard.errors import TowersError

__all__ = ["RuntimeStartedError", "configure_gpus", "connect", "leave_together",
           "set_logical_devices", "start_server", "start_worker"]


class RuntimeStartedError(TowersError, RuntimeError):
    """A device setting came after TensorFlow's runtime had fixed the devices."""


def runtime_started() -> bool:
    """True once TensorFlow's eager runtime exists (its devices are fixed)."""
    return context.context()._context_handle is not None  # no public query


def _check(visible: Any, memory_growth: Any, memory_limit_mb: Any) -> list[int] | None:
    if visible is not None:
        if isinstance(visible, (str, bytes)) or not isinstance(visible, Sequence):
            raise TypeError(f"visible must be None or a list of GPU indices (ints), got "
                            f"{visible!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in visible):
            raise ValueError(f"visible must hold GPU indices (ints >= 0), got {list(visible)!r}")
        if len(set(visible)) != len(visible):
            raise ValueError(f"visible names a GPU twice: {list(visible)!r}")
    if memory_growth is not None and not isinstance(memory_growth, bool):
        raise TypeError(f"memory_growth must be None, True or False, got {memory_growth!r}")
    if memory_limit_mb is not None:
        if isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int):
            raise TypeError(f"memory_limit_mb must be None or an int (MiB), got "
                            f"{memory_limit_mb!r}")
        positive_int("memory_limit_mb", memory_limit_mb)
        if memory_growth:
            raise ValueError("memory_growth=True and memory_limit_mb exclude each other "
                             "(TensorFlow refuses memory growth on a GPU with a memory limit)")
    return None if visible is None else list(visible)


def configure_gpus(visible: Sequence[int] | None = None, memory_growth: bool | None = None,
                   memory_limit_mb: int | None = None) -> list[str]:
    """Choose this process's GPUs (``visible`` indices; None: all) and how they take memory
    (``memory_growth``, or ``memory_limit_mb`` MiB each; None: TensorFlow's default); call it
    first thing. Returns the chosen GPUs' physical names; ``RuntimeStartedError`` when late."""
    indices = _check(visible, memory_growth, memory_limit_mb)
    gpus = tf.config.list_physical_devices("GPU")
    if indices is not None and any(i >= len(gpus) for i in indices):
        raise ValueError(f"visible={indices} asks for a GPU that does not exist: this machine "
                         f"has {len(gpus)} GPU(s) {[g.name for g in gpus]} (indices "
                         f"0..{len(gpus) - 1})" if gpus else
                         f"visible={indices} asks for a GPU, and this machine has none "
                         f"(use visible=[] or None)")
    chosen = gpus if indices is None else [gpus[i] for i in indices]
    late = ("configure_gpus must be called before TensorFlow initializes its devices; call it "
            "first thing in the program, before any TensorFlow op or device listing (and "
            "before towers.simulate_devices or start_worker)")
    asked = indices is not None or memory_growth is not None or memory_limit_mb is not None
    if asked and runtime_started():
        raise RuntimeStartedError(late)
    try:
        if indices is not None:
            tf.config.set_visible_devices(chosen, "GPU")
        for gpu in chosen:
            if memory_growth is not None:
                tf.config.experimental.set_memory_growth(gpu, memory_growth)
            if memory_limit_mb is not None:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)])
    except RuntimeError as err:  # the runtime started between the check and the call
        raise RuntimeStartedError(f"{late} ({err})") from err
    return [g.name for g in chosen]


def set_logical_devices(n: int) -> None:
    """Split the host CPU into ``n`` logical devices (``RuntimeError``: too late)."""
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
            "the cluster runtime first thing in the program, before any TensorFlow op.") from err


def _this_task(cluster: Any, towers: int | None, what: str) -> tuple[Cluster, int]:
    found = resolve(cluster)
    if found.task_type is None:
        raise ValueError(f"{what} needs this process's task: set TF_CONFIG's 'task' or pass it")
    return found, positive_int("towers per task", towers_per_task() if towers is None else towers)


def start_worker(cluster: Any = None, towers: int | None = None) -> list[str]:
    """Join the cluster for between-graph training, as MWMS: ``towers`` CPUs (default
    ``$TOWERS_PER_TASK`` or 1), collectives led by the chief; return this task's towers."""
    found, n = _this_task(cluster, towers, "start_worker")
    set_logical_devices(n)
    set_local_task(str(found.task_type), int(found.task_index or 0))  # its devices: short names
    ctx = context.context()
    try:
        ctx.configure_collective_ops(
            collective_leader=found.task_name(*found.chief),
            device_filters=(found.task_name(),))  # don't wait on the other tasks' devices
    except RuntimeError as err:
        raise RuntimeError("start_worker came too late: TensorFlow's runtime already started. "
                           "Call towers.cluster.start_worker() first thing in the program."
                           ) from err
    port = int(found.jobs[str(found.task_type)][int(found.task_index or 0)].rsplit(":", 1)[1])
    ctx.enable_collective_ops(tensorflow_server_pb2.ServerDef(
        cluster=found.cluster_spec().as_cluster_def(), default_session_config=ctx.config,
        job_name=found.task_type, task_index=found.task_index, protocol="grpc", port=port))
    ctx.ensure_initialized()
    return [f"/device:CPU:{i}" for i in range(n)]


def start_server(cluster: Any = None, towers: int | None = None) -> tf.distribute.Server:
    """Start this task's ``tf.distribute.Server`` with ``towers`` CPUs (in-graph mode)."""
    found, n = _this_task(cluster, towers, "start_server")
    # the server's devices come from its own ConfigProto, not the eager context's
    config = tf.compat.v1.ConfigProto(device_count={"CPU": n})
    # a remote task optimizes its graph pieces itself: keep additions as written there too
    rewrites = config.graph_options.rewrite_options
    for name in REWRITES:
        setattr(rewrites, name, rewriter_config_pb2.RewriterConfig.OFF)
    # and no AddN turned into AssignAdds summed in arrival order (compile.step.PhasedStep)
    rewrites.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    return tf.distribute.Server(
        found.cluster_spec(), job_name=found.task_type, task_index=found.task_index,
        protocol="grpc", config=config, start=True)


_LOCAL = ("127.0.0.1", "localhost", "[::1]")


def leave_together(cluster: Any = None, limit: float = 60.0) -> bool:
    """Wait until every training task has called this, or ``limit`` s; True if all came.
    Call it after the last step: a worker that exits at once can leave a peer's last pull
    unanswered. On one machine each task marks a file; across machines, one all-reduce."""
    positive_float("limit", limit)
    found = _this_task(cluster, 1, "leave_together")[0]
    workers = found.num_workers
    addresses = [a for job in ("chief", "worker") for a in found.jobs.get(job, ())]
    if not all(a.rsplit(":", 1)[0] in _LOCAL for a in addresses):
        key = shared_keys(2)
        try:
            with tf.device("/device:CPU:0"), watched(limit, "towers: leave_together"):
                collective_ops.all_reduce_v2(
                    tf.ones([1]), group_size=workers, group_key=key, instance_key=key + 1,
                    merge_op="Add", final_op="Id")
        except (tf.errors.DeadlineExceededError, tf.errors.CancelledError):
            return False
        return True
    spec = json.dumps(found.as_dict(), sort_keys=True).encode()
    folder = os.path.join(tempfile.gettempdir(),
                          f"towers-done-{hashlib.sha256(spec).hexdigest()[:16]}")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, found.task_name().replace("/", "_")), "w").close()
    return poll_until(lambda: len(os.listdir(folder)) >= workers, limit)


def connect(cluster: Any, towers_per_task: int, job: str = "worker") -> list[str]:
    """Connect this client to a running cluster; every task's tower names (full)."""
    found = resolve(cluster)
    tf.config.experimental_connect_to_cluster(found.cluster_spec())
    towers = found.tower_devices(towers_per_task, job=job)
    full = tf.DeviceSpec.from_string
    known = {full(d.name).to_string() for d in tf.config.list_logical_devices()}
    missing = [d for d in towers if full(d).to_string() not in known]
    if missing:
        raise ValueError(f"the cluster does not serve {missing}; it serves {sorted(known)}")
    return towers
