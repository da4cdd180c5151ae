"""``AllTowers``: one collective over every tower of every worker, in MWMS's order.

:class:`~towers.cluster.cross_worker.CrossWorker` adds a worker's towers first and then
all-reduces W partial sums. MultiWorkerMirroredStrategy (MWMS) on CPU does something
else (read from TF 2.21's ``CollectiveAllReduce._all_reduce`` and
``CollectiveReplicaLauncher.batch_all_reduce``): every replica is a member of ONE
collective group of size W·T; the gradients are reversed (``dense_values.reverse()``),
flattened and concatenated into one vector ("pack", ``bytes_per_pack=0``), all-reduced
with ``all_reduce_v2`` (RING, ``merge_op="Add"``, ``final_op="Id"``) and split back.
This reducer issues that very op from every local tower, so the runtime's ring adds
the same W·T vectors in the same order and the result is bitwise MWMS's::

    worker 0  tower 0: flat(g00[::-1]) ─┐
              tower 1: flat(g01[::-1]) ─┤  all_reduce_v2, group of W·T = 4, RING:
    worker 1  tower 0: flat(g10[::-1]) ─┤  member r adds chunk c in the ring's order
              tower 1: flat(g11[::-1]) ─┘  (rank = task, then device), same op as MWMS
                        │
              split, reverse back ──▶ every tower its own copy (no extra copies)

Ring over n = W·T members, chunk c of the vector (the runtime's RingReducer)::

    step s = 0 … n−2:  member r sends its partial sum of chunk (r − s) mod n to r + 1
    then n − 1 steps of all-gather: every member ends with every chunk's total

``op="mean"`` divides the sum by W afterwards (exact for W a power of two), for a
``TowerTrainer`` whose towers divide by the *local* batch; with a
:class:`~towers.cluster.trainer.WorkerTrainer` (loss over the global batch) use
``op="sum"``: that is MWMS's own arithmetic.

Summation depth: W·T − 1 (the ring over every tower). Cost per step of S bytes of
gradients: 2(n − 1)α + 2(n − 1)/n·Sβ + (n − 1)/n·Sγ, n = W·T.

References:
    TensorFlow ``cross_device_ops.CollectiveAllReduce``,
    ``cross_device_utils.CollectiveReplicaLauncher`` (TF 2.21);
    Patarasuk & Yuan, *Bandwidth optimal all-reduce algorithms* (2009).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from towers.allreduce.machinery.tf_collective_ops import shared_keys, token
from towers.cluster.cross_worker import check_cross_worker

__all__ = ["AllTowers"]


class AllTowers:
    """A ``GradientReducer``: every tower of every worker in one MWMS-ordered collective.

    Args:
        num_workers: worker processes (default: chief + workers of TF_CONFIG).
        op: ``"sum"`` (MWMS's: the loss is already over the global batch) or ``"mean"``
            (divide by the worker count; see the module docstring).
        timeout_seconds: per collective op: a missing worker becomes an error, not a hang.
        communication_hint: ``"ring"`` (MWMS's ``CommunicationImplementation.RING``) or
            ``"auto"``.

    Raises:
        ValueError: a bad worker count, op, timeout or hint.

    Example:
        >>> trainer = WorkerTrainer(model, opt, loss, devices=start_worker(),
        ...                         all_reduce=AllTowers(op="sum"))     # doctest: +SKIP
    """

    cross_worker = True
    """Sums over every worker (the capability table's ``cross-worker`` kind)."""

    def __init__(self, num_workers: int | None = None, *, op: str = "sum",
                 timeout_seconds: float = 60.0, communication_hint: str = "ring") -> None:
        self.num_workers = check_cross_worker(num_workers, op, timeout_seconds)
        if communication_hint not in ("ring", "auto"):
            raise ValueError(f"communication_hint must be 'ring' or 'auto', "
                             f"got {communication_hint!r}")
        self.op, self.timeout_seconds = op, float(timeout_seconds)
        self.communication_hint = communication_hint
        self.devices: list[str] = []
        self.group_key = self.instance_key = -1

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        """Draw the keys (one group, one instance; eagerly, once) and every tower's token."""
        self.devices = list(devices)
        self.group_key = shared_keys(2)
        self.instance_key = self.group_key + 1
        for device in self.devices:
            token(device)

    def summation_depth(self, towers: int) -> int:
        """Additions on the longest path to one element: W·T − 1."""
        return self.num_workers * towers - 1

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """``grads[tower][var]`` -> the reduced gradient of every variable, on every tower.

        Raises:
            RuntimeError: called before :meth:`build`, or with another tower count.
            tf.errors.DeadlineExceededError: a worker did not join within the timeout.
        """
        if self.group_key < 0 or len(grads) != len(self.devices):
            raise RuntimeError("AllTowers.build(variables, devices) must run first, once "
                               "per trainer, with the towers that reduce_gradients receives")
        return [self._reduce_tower(list(g), t) for t, g in enumerate(grads)]

    def _reduce_tower(self, grads: list[tf.Tensor], tower: int) -> list[tf.Tensor]:
        group_size = self.num_workers * len(self.devices)
        with tf.device(self.devices[tower]):
            backwards = grads[::-1]  # MWMS reverses before packing
            flat = tf.concat([tf.reshape(g, [-1]) for g in backwards], axis=0)
            if group_size > 1:
                flat = collective_ops.all_reduce_v2(
                    flat, group_size=group_size, group_key=self.group_key,
                    instance_key=self.instance_key, merge_op="Add", final_op="Id",
                    communication_hint=self.communication_hint,
                    timeout=self.timeout_seconds, ordering_token=token(self.devices[tower]),
                )
            if self.op == "mean" and self.num_workers > 1:
                flat = flat / tf.constant(self.num_workers, flat.dtype)
            sizes = [int(g.shape.num_elements() or 0) for g in backwards]
            parts = tf.split(flat, sizes, axis=0)
            out = [tf.reshape(p, g.shape) for p, g in zip(parts, backwards, strict=True)]
        return out[::-1]

    def __repr__(self) -> str:
        return f"AllTowers(num_workers={self.num_workers}, op={self.op!r})"
