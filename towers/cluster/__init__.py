"""Training on several processes with TensorFlow's own distributed runtime.

::

    spec.py      resolve(): TF_CONFIG / ClusterSpec / dict / ClusterResolver → Cluster
                 (this task, the chief, every task's tower names); localhost clusters
    runtime.py   configure_gpus(); start_worker() (between-graph), start_server() +
                 connect() (in-graph); leave_together(): workers exit after the last step
    server.py    ``python -m towers.cluster.server``: serve one task's towers
    launcher.py  launch(): one process per task, prefixed output, timeouts;
                 start_servers(): local worker and ps servers for one client
    cross_worker.py  CrossWorker (local towers, then across workers) and AllTowers
                 (one collective over all W·T towers, MWMS's order, bitwise)
    trainer.py   WorkerTrainer: loss over the global batch; chief checkpoints, resume
    data.py      shard_dataset() (tf.data's auto-shard policies), global_to_worker_batches()
    ps.py        parameter servers: shard_variables(), ParameterStore (versioned SGD)
    ps_train.py  AsyncTrainer: async workers pushing to the ps, every update logged;
                 save_log / load_log, replay(): the log replayed bitwise in NumPy

``towers launch`` (:mod:`towers.cli.launch`) is the command line of ``launch``.
"""

from __future__ import annotations

from towers.cluster.cross_worker import AllTowers, CrossWorker
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
from towers.cluster.trainer import WorkerTrainer

__all__ = ["HOST", "TOWERS_ENV", "AllTowers", "AsyncTrainer", "Cluster", "CrossWorker",
           "ParameterServerLost", "ParameterStore", "RuntimeStartedError", "UpdateLog",
           "UpdateRecord", "WorkerTrainer", "configure_gpus", "connect", "connect_ps",
           "free_ports", "global_to_worker_batches", "launch", "leave_together", "load_log",
           "local_cluster", "replay", "resolve", "save_log", "set_logical_devices",
           "shard_dataset", "shard_variables", "start_server", "start_servers", "start_worker",
           "tf_config", "towers_per_task"]
