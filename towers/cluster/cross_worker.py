"""``CrossWorker``: between-graph all-reduce over every tower of every worker.

Each worker process runs the same program and its own ``TowerTrainer`` on its own
towers; the trainer hands this reducer ``grads[tower][var]`` and gets back what
every tower applies. W workers, T towers each (here W = 2, T = 2)::

    worker 0   tower 0: g00 ─┐ local sum in tower order        ┌─▶ tower 0
               tower 1: g01 ─┴▶ s0 = g00 + g01 (on tower 0) ─┐ │─▶ tower 1
                                                             │ all_reduce_v2, group of W
    worker 1   tower 0: g10 ─┐                               │ (one op per variable,
               tower 1: g11 ─┴▶ s1 = g10 + g11 (on tower 0) ─┘  tower 0 of each worker)
                                    result = (s0 + s1) / W  ──▶ every local tower

Why ``/ W`` (``op="mean"``, the default): each worker's ``TowerTrainer`` divides its
loss by its *local* batch, so with equal local batches the global mean gradient is
the mean of the workers' gradients. For W a power of two the division is exact, and
the result equals dividing every loss by the global batch (MultiWorkerMirroredStrategy).

Collective keys: TF's group and instance keys are process-global and must be equal on
every worker for the ops to meet. They come from the cross-process range of
:mod:`towers.allreduce.machinery.tf_collective_ops`
(:func:`~towers.allreduce.machinery.tf_collective_ops.shared_keys`,
apart from towers' local collectives and tf.distribute's), one block per reducer at
``build``: identical on every worker when every worker builds its reducers in the same
order, as the same program does. All of a worker's cross-worker ops sit on its tower 0
and use that device's one ordering token (``tf_collective_ops.token``), so they run in
program order (without a token, automatic control dependencies may start them in
different orders on two workers, and they wait for each other until the timeout).

Summation depth: (T − 1) local additions, then the runtime's ring over W: W − 1.
Cost per variable of S bytes: (T − 1) local copies and adds, then the ring's
2(W − 1)α + 2(W − 1)/W·Sβ + (W − 1)/W·Sγ across workers.

MultiWorkerMirroredStrategy adds in another order (one collective over all W·T
replicas); :class:`towers.cluster.flat.AllTowers` reproduces it bit for bit.

References:
    TensorFlow ``CollectiveReplicaLauncher`` (ordering tokens, keys);
    Goyal et al., *Accurate, Large Minibatch SGD* (2017), hierarchical all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from towers.allreduce import send
from towers.allreduce.machinery.tf_collective_ops import shared_keys, token
from towers.cluster.spec import resolve
from towers.guard.arguments import positive_float, positive_int

__all__ = ["CrossWorker"]


def check_cross_worker(num_workers: int | None, op: str, timeout_seconds: float) -> int:
    """The worker count (from the cluster when None), after checking the three settings
    every cross-worker reducer takes.

    Raises:
        ValueError: a bad worker count, op or timeout, naming it.
    """
    workers = positive_int(
        "num_workers", resolve().num_workers if num_workers is None else num_workers)
    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    positive_float("timeout_seconds", timeout_seconds)
    return workers


class CrossWorker:
    """A ``GradientReducer``: sum the local towers in tower order, then across workers.

    Args:
        num_workers: worker processes taking part (default: chief + workers of TF_CONFIG).
        op: ``"mean"`` (divide by the worker count; see the module docstring) or ``"sum"``.
        timeout_seconds: per collective op: a missing worker becomes an error, not a hang.
        communication_hint: ``"ring"`` or ``"auto"`` (``"nccl"`` across GPUs).

    Raises:
        ValueError: a bad worker count, op or timeout.

    Example:
        >>> devices = towers.cluster.start_worker()         # doctest: +SKIP
        >>> trainer = towers.TowerTrainer(model, opt, loss, devices=devices,
        ...                               all_reduce=CrossWorker())    # doctest: +SKIP
    """

    cross_worker = True
    """Sums over every worker (the capability table's ``cross-worker`` kind)."""

    def __init__(self, num_workers: int | None = None, *, op: str = "mean",
                 timeout_seconds: float = 60.0, communication_hint: str = "ring") -> None:
        self.num_workers = check_cross_worker(num_workers, op, timeout_seconds)
        self.op, self.timeout_seconds = op, float(timeout_seconds)
        self.communication_hint = communication_hint
        self.devices: list[str] = []
        self.group_key = self.first_instance_key = -1

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        """Draw this reducer's keys (eagerly, once) and tower 0's ordering token."""
        self.devices = list(devices)
        first = shared_keys(len(variables) + 1)
        self.group_key, self.first_instance_key = first, first + 1
        token(self.devices[0])

    def summation_depth(self, towers: int) -> int:
        """Additions on the longest path to one element: (T − 1) + (W − 1)."""
        return (towers - 1) + (self.num_workers - 1)

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """``grads[tower][var]`` -> the reduced gradient of every variable, on every tower.

        Raises:
            RuntimeError: called before :meth:`build`, or with another tower count.
            tf.errors.DeadlineExceededError: a worker did not join within the timeout.
        """
        if self.group_key < 0 or len(grads) != len(self.devices):
            raise RuntimeError("CrossWorker.build(variables, devices) must run first, once "
                               "per trainer, with the towers that reduce_gradients receives")
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
            return collective_ops.all_reduce_v2(
                total, group_size=self.num_workers, group_key=self.group_key,
                instance_key=self.first_instance_key + index, merge_op="Add",
                final_op="Div" if self.op == "mean" else "Id",
                communication_hint=self.communication_hint, timeout=self.timeout_seconds,
                ordering_token=token(home),
            )

    def __repr__(self) -> str:
        return f"CrossWorker(num_workers={self.num_workers}, op={self.op!r})"

