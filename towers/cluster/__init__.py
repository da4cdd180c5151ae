"""Training on several processes with TensorFlow's own distributed runtime: clusters from
TF_CONFIG (spec), the runtime started (runtime, server), localhost launches (launcher),
cross-worker reducers and trainer, input sharding (data), parameter servers (ps, ps_train).
"""

from __future__ import annotations

from towers.cluster.cross_worker import AllTowers, CrossWorker, WorkerTrainer
from towers.cluster.data import global_to_worker_batches, shard_dataset
from towers.cluster.launcher import launch, start_servers
from towers.cluster.ps import ParameterServerLost, ParameterStore, connect_ps, shard_variables
from towers.cluster.ps_train import (
    AsyncTrainer,
    UpdateLog,
    UpdateRecord,
    load_log,
    replay,
    save_log,
)
from towers.cluster.runtime import (
    RuntimeStartedError,
    configure_gpus,
    connect,
    leave_together,
    set_logical_devices,
    start_server,
    start_worker,
)
from towers.cluster.spec import (
    HOST,
    TOWERS_ENV,
    Cluster,
    free_ports,
    local_cluster,
    resolve,
    tf_config,
    towers_per_task,
)

__all__ = ["HOST", "TOWERS_ENV", "AllTowers", "AsyncTrainer", "Cluster", "CrossWorker",
           "ParameterServerLost", "ParameterStore", "RuntimeStartedError", "UpdateLog",
           "UpdateRecord", "WorkerTrainer", "configure_gpus", "connect", "connect_ps",
           "free_ports", "global_to_worker_batches", "launch", "leave_together", "load_log",
           "local_cluster", "replay", "resolve", "save_log", "set_logical_devices",
           "shard_dataset", "shard_variables", "start_server", "start_servers", "start_worker",
           "tf_config", "towers_per_task"]
