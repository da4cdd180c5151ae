"""Training on several processes with TensorFlow's own distributed runtime.

::

    spec.py      resolve(): TF_CONFIG / ClusterSpec / dict / ClusterResolver → Cluster
                 (this task, the chief, every task's tower device names)
    local.py     localhost clusters: free ports, TOWERS_PER_TASK
    runtime.py   start_worker() (between-graph), start_server() + connect() (in-graph),
                 leave_together(): every worker exits after the last one's last step
    launcher.py  launch(): one process per task, prefixed output, timeouts;
                 start_servers(): local tf.distribute.Server processes for a client
    cross_worker.py  CrossWorker: a GradientReducer that sums the local towers in tower
                 order, then all-reduces across workers with TF collective ops
    server.py    ``python -m towers.cluster.server``: serve one task's towers
    ps.py        parameter servers: shard_variables(), ParameterStore (versioned SGD)
    ps_train.py  AsyncTrainer: async workers pushing to the ps, every update logged
    ps_replay.py save_log/load_log, replay(): the log replayed bitwise in NumPy
    ps_local.py  local_ps_cluster(): worker + ps servers for one client; connect_ps()
    flat.py      AllTowers: one collective over all W·T towers, MWMS's order (bitwise)
    trainer.py   WorkerTrainer: loss over the global batch (unequal/empty workers)
    checkpoints.py  save_on_chief / restore_latest: chief checkpoints by steps taken, resume
    data.py      shard_dataset() (tf.data's auto-shard policies), global_to_worker_batches()
    gpus.py      configure_gpus(): visible GPUs, memory growth / limit, set first thing

``towers launch`` (:mod:`towers.cli.launch`) is the command line of ``launch``.
"""

from __future__ import annotations

from towers.cluster.cross_worker import CrossWorker
from towers.cluster.data import global_to_worker_batches, shard_dataset
from towers.cluster.flat import AllTowers
from towers.cluster.gpus import RuntimeStartedError, configure_gpus
from towers.cluster.launcher import launch, start_servers
from towers.cluster.local import HOST, TOWERS_ENV, free_ports, local_cluster, towers_per_task
from towers.cluster.ps import ParameterServerLost, ParameterStore, shard_variables
from towers.cluster.ps_local import connect_ps, local_ps_cluster
from towers.cluster.ps_replay import load_log, replay, save_log
from towers.cluster.ps_train import AsyncTrainer, UpdateLog, UpdateRecord
from towers.cluster.runtime import (
    connect,
    leave_together,
    set_logical_devices,
    start_server,
    start_worker,
)
from towers.cluster.spec import TASK_TYPES, Cluster, resolve, tf_config
from towers.cluster.trainer import WorkerTrainer

__all__ = [
    "HOST",
    "TASK_TYPES",
    "TOWERS_ENV",
    "AllTowers",
    "AsyncTrainer",
    "Cluster",
    "CrossWorker",
    "ParameterServerLost",
    "ParameterStore",
    "RuntimeStartedError",
    "UpdateLog",
    "UpdateRecord",
    "WorkerTrainer",
    "configure_gpus",
    "connect",
    "connect_ps",
    "free_ports",
    "global_to_worker_batches",
    "launch",
    "leave_together",
    "load_log",
    "local_cluster",
    "local_ps_cluster",
    "replay",
    "resolve",
    "save_log",
    "set_logical_devices",
    "shard_dataset",
    "shard_variables",
    "start_server",
    "start_servers",
    "start_worker",
    "tf_config",
    "towers_per_task",
]
