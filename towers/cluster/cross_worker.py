"""Training across worker processes: ``WorkerTrainer`` and its reducers ``CrossWorker``
and ``AllTowers``.

Each worker runs the same program and its own ``WorkerTrainer`` on its own towers; the
trainer hands a reducer ``grads[tower][var]`` and gets back what every tower applies.
W workers, T towers each (here W = 2, T = 2)::

    CrossWorker: the local towers first, then W partial sums (depth (T − 1) + (W − 1))
    worker 0   tower 0: g00 ─┐ local sum in tower order        ┌─▶ tower 0
               tower 1: g01 ─┴▶ s0 = g00 + g01 (on tower 0) ─┐ │─▶ tower 1
                                                             │ all_reduce_v2, group of W
    worker 1   tower 0: g10 ─┐                               │ (one op per variable,
               tower 1: g11 ─┴▶ s1 = g10 + g11 (on tower 0) ─┘  tower 0 of each worker)
                                    result = (s0 + s1) / W  ──▶ every local tower

    AllTowers: ONE group of W·T, MultiWorkerMirroredStrategy's order (depth W·T − 1)
    worker 0  tower 0: flat(g00[::-1]) ─┐
              tower 1: flat(g01[::-1]) ─┤  all_reduce_v2, group of W·T, RING:
    worker 1  tower 0: flat(g10[::-1]) ─┤  member r adds chunk c in the ring's order
              tower 1: flat(g11[::-1]) ─┘  (rank = task, then device)
                        │
              split, reverse back ──▶ every tower its own copy

``WorkerTrainer``'s loss is over the GLOBAL batch: the mean is over B = Σ b_k, as MWMS's
``compute_average_loss(..., global_batch_size=B)``; the workers' counts b_k are all-reduced
inside the step (exact: integers in float32). Checkpoints: the chief alone writes
``ckpt-<steps taken>`` (:func:`save_on_chief`), every worker restores the newest good one
(:func:`restore_latest`) and goes on with that step.

References: TensorFlow ``cross_device_ops.CollectiveAllReduce``; Goyal et al., *Accurate,
Large Minibatch SGD* (2017); Patarasuk & Yuan, *Bandwidth optimal all-reduce algorithms*.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from towers.allreduce import send
from towers.allreduce.machinery.tf_collective_ops import shared_keys, token
from towers.cluster.spec import resolve
from towers.guard.arguments import check_choice, non_negative_int, positive_float, positive_int
from towers.guard.errors import CheckpointError
from towers.split import Shards, shard_sizes
from towers.step import Reduced, TowerTrainer
from towers.tower import Gradients
from towers.training.checkpoint import latest, restore, verify, write
from towers.training.losses import reduction_of
from towers.training.protocol import Trainer

__all__ = ["AllTowers", "CrossWorker", "WorkerTrainer", "restore_latest", "save_on_chief",
           "sum_over", "worker_slice"]


def sum_over(value: tf.Tensor, group_size: int, group_key: int, instance_key: int,
             device: str, hint: str = "ring", final_op: str = "Id") -> tf.Tensor:
    """``value`` summed over the group, in ``device``'s collective order (``token``)."""
    return collective_ops.all_reduce_v2(
        value, group_size=group_size, group_key=group_key, instance_key=instance_key,
        merge_op="Add", final_op=final_op, communication_hint=hint, ordering_token=token(device))


class _AcrossWorkers:
    """What both reducers share: ``num_workers`` (default: TF_CONFIG's), ``op`` (``"mean"``
    or ``"sum"``), the step's ``timeout_seconds`` and a ``communication_hint``."""

    cross_worker = True  # the capability table's ``cross-worker`` kind
    hints: tuple[str, ...] = ("ring", "auto", "nccl")
    default_op = "mean"

    def __init__(self, num_workers: int | None = None, *, op: str | None = None,
                 timeout_seconds: float = 60.0, communication_hint: str = "ring") -> None:
        self.num_workers = positive_int(
            "num_workers", resolve().num_workers if num_workers is None else num_workers)
        self.op = check_choice("op", self.default_op if op is None else op, ("mean", "sum"))
        self.timeout_seconds = positive_float("timeout_seconds", timeout_seconds)
        check_choice("communication_hint", communication_hint, self.hints)
        self.communication_hint = communication_hint
        self.devices: list[str] = []
        self.group_key = self.instance_key = -1

    def _draw(self, devices: Sequence[str], keys: int) -> None:
        self.devices = list(devices)
        self.group_key = shared_keys(keys)
        self.instance_key = self.group_key + 1
        for device in self.devices:
            token(device)

    def _check_built(self, grads: Sequence[Sequence[tf.Tensor]]) -> None:
        if self.group_key < 0 or len(grads) != len(self.devices):
            raise RuntimeError(f"{type(self).__name__}.build(variables, devices) must run "
                               "first, once per trainer, with the towers that "
                               "reduce_gradients receives")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_workers={self.num_workers}, op={self.op!r})"


class CrossWorker(_AcrossWorkers):
    """A ``GradientReducer``: the local towers in tower order, then across workers (``mean``)."""

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        self._draw(devices[:1], len(variables) + 1)
        self.devices = list(devices)

    def summation_depth(self, towers: int) -> int:
        """Additions on the longest path: (T − 1) + (W − 1)."""
        return (towers - 1) + (self.num_workers - 1)

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        self._check_built(grads)
        home = self.devices[0]
        reduced = [self._reduce_one([g[j] for g in grads], j, home) for j in range(len(grads[0]))]
        return [[send(r, device, src=home, note="cross-worker") for r in reduced]
                for device in self.devices]

    def _reduce_one(self, values: list[tf.Tensor], index: int, home: str) -> tf.Tensor:
        with tf.device(home):
            total = send(values[0], home, note="local-sum")
            for v in values[1:]:
                total = total + send(v, home, note="local-sum")
            if self.num_workers == 1 or values[0].shape.num_elements() == 0:
                return total
            return sum_over(total, self.num_workers, self.group_key, self.instance_key + index,
                            home, self.communication_hint, "Div" if self.op == "mean" else "Id")


class AllTowers(_AcrossWorkers):
    """A ``GradientReducer``: every tower of every worker in one MWMS-ordered sum (``sum``)."""

    hints = ("ring", "auto")
    default_op = "sum"

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        self._draw(devices, 2)

    def summation_depth(self, towers: int) -> int:
        """Additions on the longest path: W·T − 1."""
        return self.num_workers * towers - 1

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        self._check_built(grads)
        return [self._reduce_tower(list(g), t) for t, g in enumerate(grads)]

    def _reduce_tower(self, grads: list[tf.Tensor], tower: int) -> list[tf.Tensor]:
        group_size, device = self.num_workers * len(self.devices), self.devices[tower]
        with tf.device(device):
            backwards = grads[::-1]  # MWMS reverses before packing
            flat = tf.concat([tf.reshape(g, [-1]) for g in backwards], axis=0)
            if group_size > 1:
                flat = sum_over(flat, group_size, self.group_key, self.instance_key, device,
                                self.communication_hint)
            if self.op == "mean" and self.num_workers > 1:
                flat = flat / tf.constant(self.num_workers, flat.dtype)
            sizes = [int(g.shape.num_elements() or 0) for g in backwards]
            parts = tf.split(flat, sizes, axis=0)
            out = [tf.reshape(p, g.shape) for p, g in zip(parts, backwards, strict=True)]
        return out[::-1]


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
        self.num_workers = n = default.num_workers
        if all_reduce is None:
            all_reduce = default
        elif getattr(all_reduce, "op", "sum") != "sum":
            raise ValueError(f"all_reduce must sum across workers (op='sum'): the loss is "
                             f"already divided by the global batch; got {all_reduce!r}")
        elif n > 1 and getattr(all_reduce, "num_workers", None) != n:
            raise ValueError(
                f"WorkerTrainer(num_workers={n}) needs an all_reduce across those {n} workers "
                f"— AllTowers({n}, op='sum') (the default) or CrossWorker({n}, op='sum'); got "
                f"all_reduce={all_reduce!r}, which would leave every worker training alone")
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


def save_on_chief(trainer: Trainer, directory: str, steps: int, cluster: Any = None,
                  keep: int | None = None) -> str | None:
    """On the chief, write the trainer's state as ``directory/ckpt-<steps>`` (``steps``
    taken, skipped ones included; the ``keep`` newest kept) and return its prefix."""
    if not resolve(cluster).is_chief:
        return None
    return write(trainer, directory, steps, {"steps": steps}, keep)


def restore_latest(trainer: Trainer, directory: str) -> int:
    """On every worker, restore the newest good checkpoint of ``directory``; return the next
    step to run (0 without one). ``CheckpointError``: it does not fit (nothing changed)."""
    prefix = latest(directory)
    if prefix is None:
        return 0
    position = verify(prefix)
    steps = position.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise CheckpointError(prefix, "its position holds no count of steps taken (not written "
                              "by save_on_chief): the step to go on with is unknown")  # fmt: skip
    restore(trainer, prefix)
    return steps
