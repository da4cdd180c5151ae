"""``WorkerTrainer``: one worker's ``TowerTrainer`` whose loss is over the GLOBAL batch.

A plain ``TowerTrainer`` divides its towers' losses by the batch it was given: on a
worker that is the *local* batch, right only when every worker holds as many examples
(then ``CrossWorker(op="mean")`` divides by W). With unequal local batches (a global
batch B not divisible by W) the mean must be over B, as MultiWorkerMirroredStrategy's
``tf.nn.compute_average_loss(..., global_batch_size=B)`` does. This trainer learns B
inside the step by all-reducing the local counts (exact: integers in float32)::

    global batch B ─split over workers (shard_sizes(B, W))─▶ worker k: b_k examples
      worker k:  b_k ──all_reduce_v2 (group of W)──▶ B = Σ b_k
                 shard_sizes(b_k, T) over its towers; tower loss = Σ per-example / B
                 gradients ──AllTowers(op="sum") or CrossWorker(op="sum")──▶ apply

so the gradient every worker applies is Σ over all examples / B, whatever the split.
:func:`worker_slice` cuts a worker's part of a global batch with that rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from towers.allreduce.tf_collective_ops import shared_keys, token
from towers.cluster.flat import AllTowers
from towers.cluster.spec import resolve
from towers.guard.inputs import batch_tensors, check_batch_against_model
from towers.placement import read_weights
from towers.split import Shards, shard_sizes
from towers.step import TowerTrainer
from towers.tower import Gradients, empty_tower_step

__all__ = ["WorkerTrainer", "worker_slice"]


def worker_slice(batch_size: int, workers: int, worker: int) -> slice:
    """Worker ``worker``'s part of a global batch: MirroredStrategy's split over workers.

    Raises:
        ValueError: a negative size, no workers, or a worker index out of range.

    Example:
        >>> [worker_slice(5, 2, k) for k in (0, 1)]
        [slice(0, 3, None), slice(3, 5, None)]
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be at least 0, got {batch_size}")
    if workers < 1 or not 0 <= worker < workers:
        raise ValueError(f"worker must be in [0, {workers}), got {worker}")
    cut = np.cumsum([0, *shard_sizes(batch_size, workers)])
    return slice(int(cut[worker]), int(cut[worker + 1]))


class WorkerTrainer(TowerTrainer):
    """A ``TowerTrainer`` for one worker of W: losses over the global batch Σ b_k.

    Args:
        model, optimizer, loss: as for ``TowerTrainer``.
        devices: this worker's towers (what :func:`~towers.cluster.start_worker` returns).
        all_reduce: a cross-worker ``GradientReducer`` with ``op="sum"`` (default:
            ``AllTowers(num_workers, op="sum")``, bitwise MultiWorkerMirroredStrategy's order).
        num_workers: worker processes (default: from TF_CONFIG).
        timeout_seconds: of the count all-reduce (a missing worker → an error).
        **kwargs: the rest of ``TowerTrainer``'s arguments (``variables`` defaults to
            ``"replicated"``).

    Raises:
        ValueError: a bad ``num_workers`` or ``timeout_seconds``, a reducer that averages
            (``op="mean"``), or any ``TowerTrainer`` error.

    ``train_step`` returns this worker's share of the global mean loss (the workers'
    shares add up to it).
    """

    def __init__(self, model: Any, optimizer: Any, loss: Any, devices: Sequence[str],
                 all_reduce: Any = None, num_workers: int | None = None,
                 timeout_seconds: float = 60.0, **kwargs: Any) -> None:
        self.num_workers = resolve().num_workers if num_workers is None else num_workers
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) \
                or self.num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {self.num_workers!r}")
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        if all_reduce is None:
            all_reduce = AllTowers(self.num_workers, op="sum", timeout_seconds=timeout_seconds)
        if getattr(all_reduce, "op", "sum") != "sum":
            raise ValueError(f"all_reduce must sum across workers (op='sum'): the loss is "
                             f"already divided by the global batch; got {all_reduce!r}")
        kwargs.setdefault("variables", "replicated")
        self.timeout_seconds = float(timeout_seconds)
        self._count_key = shared_keys(2)
        super().__init__(model, optimizer, loss, devices=devices, all_reduce=all_reduce,
                         **kwargs)

    def _inputs(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        if _rows(x) != 0:
            return batch_tensors(x, y, sample_weight, self.model)
        # B < W leaves a worker without examples; it still joins every collective.
        check_batch_against_model(x, y, sample_weight, self.model)
        convert = tf.nest.map_structure
        weight = None if sample_weight is None else tf.convert_to_tensor(
            sample_weight, dtype=tf.as_dtype(self.model.trainable_variables[0].dtype))
        return convert(tf.convert_to_tensor, x), convert(tf.convert_to_tensor, y), weight

    def forward_backward(self, shards: Shards) -> Gradients:
        """As ``TowerTrainer``'s; on an empty worker tower 0 runs the model on 0 rows
        (as MWMS's empty replica does: loss 0, zero data gradients)."""
        if shards.sizes[0] != 0:
            return super().forward_backward(shards)
        template = self.tower_step(shards, 0)
        results = [template]
        for i in range(1, len(self.devices)):
            trainable, frozen = read_weights(self.replica_of(i), self.devices[i])
            results.append(empty_tower_step(
                self.model, trainable, frozen, template=template,
                num_towers=len(self.devices), device=self.devices[i]))
        return Gradients(tuple(results))

    def split(self, x: Any, y: Any, sample_weight: Any = None) -> Shards:
        """Cut the local batch over the towers; every tower divides by the global batch."""
        shards = super().split(x, y, sample_weight)
        return shards._replace(global_batch=self._global_batch(shards.global_batch))

    def _global_batch(self, local: tf.Tensor) -> tf.Tensor:
        if self.num_workers == 1:
            return local
        with tf.device(self.devices[0]):
            total = collective_ops.all_reduce_v2(
                tf.cast(local, tf.float32), group_size=self.num_workers,
                group_key=self._count_key, instance_key=self._count_key + 1,
                merge_op="Add", final_op="Id", communication_hint="ring",
                timeout=self.timeout_seconds, ordering_token=token(self.devices[0]),
            )
            return tf.cast(total, tf.int32)


def _rows(x: Any) -> int | None:
    """The static leading dimension of ``x``'s first leaf (None when unknown)."""
    leaf = tf.nest.flatten(x)[0]
    return tf.TensorShape(getattr(leaf, "shape", np.shape(leaf)))[0]
