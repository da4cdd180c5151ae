"""Sharded optimizer state (ZeRO stages 1–2): ring reduce-scatter, owner update, all-gather.

Every trainable variable is cut as the ring cuts it (:func:`pad_split`): ``n`` chunks of
``L = ceil(size / n)`` elements, tower ``k`` owning the real elements of chunk ``k``.
Gradients take the ring's reduce-scatter (so chunk ``k``'s sum is bitwise the ``ring``
all-reduce's), the owner's optimizer updates its shard, the ring's all-gather copies the
shards into every replica. n = 3 (``gK``: gradient chunk K, ``pK``: parameter chunk K)::

    tick       0        1      │  update (owner k)   │    2        3
               reduce-scatter  │                     │    all-gather (copy)
    tower 0   g2 ─▶1   g1 ─▶1  │  p0 ← opt_0(p0, g0) │   p0 ─▶1   p2 ─▶1
    tower 1   g0 ─▶2   g2 ─▶2  │  p1 ← opt_1(p1, g1) │   p1 ─▶2   p0 ─▶2
    tower 2   g1 ─▶0   g0 ─▶0  │  p2 ← opt_2(p2, g2) │   p2 ─▶0   p1 ─▶0

Index formula and cost: the ring's (``s = 1``), plus one optimizer update of ``S/n`` per
tower; optimizer state per tower ``≈ 1/n``. The shard variables are refreshed from the
replica before each update (so ``set_weights`` and restores need no extra step).

References:
    S. Rajbhandari et al., "ZeRO: Memory optimizations toward training trillion
    parameter models", SC 2020 (stages 1–2: optimizer state and gradients partitioned).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.packed import pad_split, unsplit
from towers.allreduce.machinery.primitives import tick_offset
from towers.allreduce.machinery.scheduled import run_slots
from towers.schedule.collectives import ring_all_gather, ring_reduce_scatter

__all__ = ["NOT_ELEMENTWISE", "ShardPlan", "VariableShards", "check_optimizer", "state_bytes"]

NOT_ELEMENTWISE = ("Adafactor", "Lamb", "Muon")
"""Optimizer classes whose update of one element reads others: a shard cannot update alone."""


@dataclasses.dataclass(frozen=True)
class VariableShards:
    """How one variable is cut: ``n`` ring chunks of ``length`` elements (zero-padded)."""

    shape: tuple[int, ...]
    size: int
    n: int
    dtype: str

    @property
    def length(self) -> int:
        """Elements per chunk, ``ceil(size / n)``."""
        return -(-self.size // self.n)

    def owned(self, owner: int) -> int:
        """How many real (unpadded) elements tower ``owner`` owns."""
        return max(0, min(self.length, self.size - owner * self.length))

    def start(self, owner: int) -> int:
        return owner * self.length


def check_optimizer(optimizer: keras.optimizers.Optimizer) -> None:
    """Refuse (``ValueError``) an optimizer whose update is not elementwise."""
    name = type(optimizer).__name__
    if name in NOT_ELEMENTWISE:
        raise ValueError(
            f"optimizer: variables='sharded' needs an elementwise optimizer (SGD, Adam, AdamW, "
            f"Nadam, RMSprop, …); {name} reads across elements or decides globally"
        )
    if getattr(optimizer, "_exclude_from_weight_decay", None) or (
        getattr(optimizer, "_exclude_from_weight_decay_pattern", None) is not None
    ):
        raise ValueError(
            "optimizer: exclude_from_weight_decay picks model variables by identity or name, "
            "and under variables='sharded' the optimizer updates shard variables; "
            "use variables='replicated'"
        )
    config = optimizer.get_config()
    if config.get("use_ema"):
        raise ValueError(
            "optimizer: use_ema=True keeps its moving averages for the variables it updates, "
            "which under variables='sharded' are flat shards: Keras's finalize_variable_values "
            "(the end of fit) and SwapEMAWeights would write them into whole model variables; "
            "use variables='replicated'"
        )
    for key in ("clipnorm", "global_clipnorm"):
        if config.get(key) is not None:
            raise ValueError(
                f"optimizer: {key}={config[key]} needs the norm of whole gradients, which no "
                "shard owner sees under variables='sharded'; use clipvalue or "
                "variables='replicated'"
            )


def state_bytes(optimizer: keras.optimizers.Optimizer) -> int:
    """Bytes held by ``optimizer.variables`` (slots, iteration count, learning rate)."""
    return sum(
        int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
        for v in optimizer.variables
    )


def _static(grad: tf.Tensor, shape: tuple[int, ...]) -> tf.Tensor:
    """``grad`` with its variable's static shape (one traced with an unknown batch may lose it)."""
    if grad.shape.is_fully_defined():
        return grad
    with tf.device(grad.device):
        return tf.ensure_shape(grad, shape)


class ShardPlan:
    """The shards of one trainer over ``devices`` (tower ``k`` owns chunk ``k``):
    ``layout[var]`` (:class:`VariableShards`), ``shards[owner][var]`` (None when empty)."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(devices)
        self.layout: list[VariableShards] = []
        self.shards: list[list[Any]] = []

    def shards_for(self, owner: int, model: keras.Model) -> list[Any]:
        """Create tower ``owner``'s shard variables from its replica ``model`` (0 first)."""
        if owner == 0:
            n = len(self.devices)
            self.layout = [
                VariableShards(tuple(int(d) for d in v.shape), int(np.prod(v.shape)), n, v.dtype)
                for v in model.trainable_variables
            ]
        row: list[Any] = []
        with tf.device(self.devices[owner]):
            for j, (v, cut) in enumerate(zip(model.trainable_variables, self.layout)):
                count = cut.owned(owner)
                if count == 0:
                    row.append(None)
                    continue
                flat = np.reshape(np.asarray(v.numpy()), [-1])
                start = cut.start(owner)
                row.append(keras.Variable(flat[start : start + count], dtype=v.dtype,
                                          name=f"shard_{owner}_{j}"))  # fmt: skip
        self.shards.append(row)
        return [s for s in row if s is not None]

    def reduce_scatter(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[Any]]:
        """``grads[tower][var]`` -> ``owned[owner][var]``: the owner's summed chunk, or None."""
        n = len(self.devices)
        owned: list[list[Any]] = [[None] * len(self.layout) for _ in range(n)]
        for j, cut in enumerate(self.layout):
            chunks = [pad_split(_static(grads[tower][j], cut.shape), n)[0] for tower in range(n)]
            summed = run_slots(ring_reduce_scatter(n), chunks, self.devices, "sum",
                               note="reduce_scatter")
            for k in range(n):
                shard = summed[k][k]  # tower k ends with chunk k reduced
                if cut.owned(k) and shard is not None:
                    with tf.device(self.devices[k]):
                        owned[k][j] = shard[: cut.owned(k)]
        return owned

    def pairs(self, owned: Sequence[Sequence[Any]]) -> list[tuple[list[Any], list[Any]]]:
        """Per owner, ``(gradient chunks, shard variables)`` of its non-empty shards."""
        kept = [[(g, s) for g, s in zip(grads, shards) if s is not None]
                for grads, shards in zip(owned, self.shards)]
        return [([g for g, _ in pairs], [s for _, s in pairs]) for pairs in kept]

    def load(self, replicas: Sequence[Any]) -> None:
        """Copy each owner's replica values into its shard variables (before the update)."""
        for k, row in enumerate(self.shards):
            with tf.device(self.devices[k]):
                variables = replicas[k].model.trainable_variables
                for v, shard, cut in zip(variables, row, self.layout):
                    if shard is not None:
                        flat = tf.reshape(tf.convert_to_tensor(v.value), [-1])
                        start = cut.start(k)
                        shard.assign(flat[start : start + cut.owned(k)])

    def all_gather(self, replicas: Sequence[Any]) -> None:
        """Copy every owner's updated shards into every replica (ring all-gather); an owner
        without shards still counts the step."""
        n = len(self.devices)
        for k, row in enumerate(self.shards):
            if all(s is None for s in row):
                with tf.device(self.devices[k]):
                    replicas[k].optimizer.iterations.assign_add(1)
        for j, cut in enumerate(self.layout):
            if cut.size == 0:
                continue
            blocks = [self._padded_shard(k, j, cut) for k in range(n)]
            slots = [[b if c == k else None for c in range(n)] for k, b in enumerate(blocks)]
            with tick_offset(n - 1):  # after the reduce-scatter's ticks, as in the ring
                gathered = run_slots(ring_all_gather(n), slots, self.devices, note="all_gather")
            for tower in range(n):
                with tf.device(self.devices[tower]):
                    value = unsplit(gathered[tower], cut.shape, cut.size)
                    target = replicas[tower].model.trainable_variables[j]
                    target.assign(value)

    def _padded_shard(self, owner: int, var: int, cut: VariableShards) -> tf.Tensor:
        """Owner's shard ``var`` zero-padded to the chunk length."""
        shard = self.shards[owner][var]
        with tf.device(self.devices[owner]):
            if shard is None:
                return tf.zeros([cut.length], cut.dtype)
            value = tf.identity(shard.value)  # a read pinned to the owner (unsplit checks)
            missing = cut.length - cut.owned(owner)
            return tf.pad(value, [[0, missing]]) if missing else value
