"""Gradient reducers across worker processes: ``CrossWorker`` and ``AllTowers``.

Each worker runs the same program and its own trainer on its own towers; the trainer
hands a reducer ``grads[tower][var]`` and gets back what every tower applies.
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

References: TensorFlow ``cross_device_ops.CollectiveAllReduce``; Goyal et al., *Accurate,
Large Minibatch SGD* (2017); Patarasuk & Yuan, *Bandwidth optimal all-reduce algorithms*.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from towers.allreduce import send
from towers.allreduce.machinery.tf_collective_ops import shared_keys, token
from towers.cluster.spec import resolve
from towers.guard.arguments import check_choice, positive_float, positive_int

__all__ = ["AllTowers", "CrossWorker", "sum_over"]


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
        group_size = self.num_workers * len(self.devices)
        device = self.devices[tower]
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
