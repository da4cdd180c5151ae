"""``WorkerTrainer``: one worker's ``TowerTrainer`` whose loss is over the GLOBAL batch.

The mean is over B = Σ b_k, as MWMS's ``compute_average_loss(..., global_batch_size=B)``;
the workers' counts b_k are all-reduced inside the step (exact: integers in float32).
Checkpoints: the chief alone writes ``ckpt-<steps taken>`` (:func:`save_on_chief`), every
worker restores the newest good one (:func:`restore_latest`) and goes on with that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.tf_collective_ops import shared_keys
from towers.cluster.cross_worker import AllTowers, sum_over
from towers.cluster.spec import resolve
from towers.guard.arguments import non_negative_int
from towers.guard.errors import CheckpointError
from towers.split import Shards, shard_sizes
from towers.step import Reduced, TowerTrainer
from towers.tower import Gradients
from towers.training import atomic
from towers.training.checkpoint import checkpoint, restore
from towers.training.losses import reduction_of
from towers.training.protocol import Trainer

__all__ = ["WorkerTrainer", "restore_latest", "save_on_chief", "worker_slice"]


def worker_slice(batch_size: int, workers: int, worker: int) -> slice:
    """Worker ``worker``'s part of a global batch: MirroredStrategy's split over workers."""
    non_negative_int("batch_size", batch_size)
    if workers < 1 or not 0 <= worker < workers:
        raise ValueError(f"worker must be in [0, {workers}), got {worker}")
    cut = np.cumsum([0, *shard_sizes(batch_size, workers)])
    return slice(int(cut[worker]), int(cut[worker + 1]))


class WorkerTrainer(TowerTrainer):
    """A ``TowerTrainer`` for one worker of W: losses over the global batch Σ b_k.

    Args:
        devices: this worker's towers (what :func:`~towers.cluster.start_worker` returns).
        all_reduce: a cross-worker reducer with ``op="sum"`` (default: ``AllTowers``).
        num_workers: worker processes (default: from TF_CONFIG).
        timeout_seconds: the step's deadline unless ``step_timeout`` is given.
    """

    batch_is_global = False  # one worker's part of a global batch spanning the workers

    def __init__(self, model: Any, optimizer: Any, loss: Any, devices: Sequence[str],
                 all_reduce: Any = None, num_workers: int | None = None,
                 timeout_seconds: float = 60.0, **kwargs: Any) -> None:
        default = AllTowers(num_workers, op="sum", timeout_seconds=timeout_seconds)  # checks
        self.num_workers = default.num_workers
        all_reduce = default if all_reduce is None else _sums_across(all_reduce, self.num_workers)
        kwargs.setdefault("variables", "replicated")  # sharded: refused by the capability table
        if self.num_workers > 1 and reduction_of(loss) == "mean_with_sample_weight":
            raise ValueError("loss: reduction='mean_with_sample_weight' divides by the sum of "
                             "sample weights over the global batch, which one worker does not "
                             "see; use 'sum_over_batch_size' (the default) or 'sum'")
        # towers.guard.reduces compares with the local towers' sum: one worker only
        kwargs.setdefault("check_algorithm", self.num_workers == 1)
        kwargs.setdefault("step_timeout", float(timeout_seconds))
        # one group (tower 0 of every worker): the batch count, then the guard's decision
        self._count_key = shared_keys(3)
        super().__init__(model, optimizer, loss, devices=devices, all_reduce=all_reduce,
                         **kwargs)
        state = [v.path for v in self.model.non_trainable_variables
                 if tf.as_dtype(v.dtype).is_floating]  # refused before any collective
        if state and self.num_workers > 1:
            raise ValueError(
                f"WorkerTrainer(num_workers={self.num_workers}) with non-trainable state "
                f"({', '.join(state)}) is not supported: semantics='one_device' averages it "
                "over this worker's towers only, so the workers' copies would drift apart. Use "
                "LayerNormalization instead of BatchNormalization, or train in one process "
                "(TowerTrainer)")

    def model_towers(self, shards: Shards) -> list[int]:
        """As ``TowerTrainer``'s; on an empty worker tower 0 runs on 0 rows (as MWMS)."""
        return sorted({0, *super().model_towers(shards)})

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """Cut the local batch over the towers; every tower divides by the global batch."""
        shards = super().split(x, y, sample_weight)
        if self.num_workers == 1:
            return shards
        total = self._sum_over_workers(tf.cast(shards.global_batch, tf.float32),
                                       self._count_key + 1)
        return shards._replace(global_batch=tf.cast(total, tf.int32))

    def reduce(self, grads: Gradients) -> Reduced:
        sparse = [v.path for v, g in zip(self.model.trainable_variables, grads.towers[0].grads)
                  if isinstance(g, tf.IndexedSlices)]
        if sparse and self.num_workers > 1:
            raise ValueError(
                f"WorkerTrainer(num_workers={self.num_workers}) with sparse gradients (of "
                f"{', '.join(sparse)}; sparse={self.sparse!r}) is not supported: the "
                "cross-worker reducers all-reduce dense gradients only. Train in one process "
                "(TowerTrainer) or replace the Embedding's sparse lookup by a dense one")
        return super().reduce(grads)

    def across_processes(self, counts: tf.Tensor) -> tf.Tensor:
        """The guard's counts summed over every worker: all skip (or raise) together,
        so no worker enters the step's collectives while another has left them."""
        if self.num_workers == 1:
            return counts
        return self._sum_over_workers(counts, self._count_key + 2)

    def _sum_over_workers(self, value: tf.Tensor, instance_key: int) -> tf.Tensor:
        """``value`` (float32, exact for small integers) summed over tower 0 of every worker."""
        with tf.device(self.devices[0]):
            return sum_over(value, self.num_workers, self._count_key, instance_key,
                            self.devices[0])


def _sums_across(all_reduce: Any, num_workers: int) -> Any:
    if getattr(all_reduce, "op", "sum") != "sum":
        raise ValueError(f"all_reduce must sum across workers (op='sum'): the loss is "
                         f"already divided by the global batch; got {all_reduce!r}")
    if num_workers > 1 and getattr(all_reduce, "num_workers", None) != num_workers:
        raise ValueError(
            f"WorkerTrainer(num_workers={num_workers}) needs an all_reduce across those "
            f"{num_workers} workers — AllTowers({num_workers}, op='sum') (the default) or "
            f"CrossWorker({num_workers}, op='sum'); got all_reduce={all_reduce!r}, which would "
            "leave every worker training alone")
    return all_reduce


def save_on_chief(
    trainer: Trainer, directory: str, steps: int, cluster: Any = None, keep: int | None = None
) -> str | None:
    """On the chief, write the trainer's state as ``directory/ckpt-<steps>`` (``steps``
    taken, skipped ones included; the ``keep`` newest kept) and return its prefix."""
    if not resolve(cluster).is_chief:
        return None
    return atomic.write(checkpoint(trainer), directory, steps, {"steps": steps}, keep)


def restore_latest(trainer: Trainer, directory: str) -> int:
    """On every worker, restore the newest good checkpoint of ``directory``; return the next
    step to run (0 without one). ``CheckpointError``: it does not fit (nothing changed)."""
    prefix = atomic.latest(directory)
    if prefix is None:
        return 0
    position = atomic.verify(prefix)
    steps = position.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise CheckpointError(prefix, "its position holds no count of steps taken (not written "
                              "by save_on_chief): the step to go on with is unknown")  # fmt: skip
    restore(trainer, prefix)
    return steps
