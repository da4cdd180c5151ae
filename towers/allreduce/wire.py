"""The :class:`Wire`: all a codec may use to talk to the other towers during one step.

A codec (:mod:`towers.allreduce.codecs`) moves data only through it: the dense
all-reduce of the configured algorithm, gathers onto one tower, and decoding on the
decoder towers with the result sent to the rest. So the bytes a codec puts on the wire
can be counted here (:func:`towers.testing.check_codec` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce
from towers.allreduce.machinery.primitives import send

__all__ = ["Wire"]


@dataclasses.dataclass(frozen=True)
class Wire:
    """What a codec may use to talk to the other towers during one step.

    Attributes:
        devices: one device per tower.
        algorithm: the dense all-reduce (called with ``op="sum"``).
        decoders: the towers that decode; the others receive decoder ``decoders[0]``'s result.
    """

    devices: tuple[str, ...]
    algorithm: AllReduce
    decoders: tuple[int, ...] = (0,)

    @property
    def towers(self) -> int:
        return len(self.devices)

    def all_reduce(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Sum ``values[tower]`` with the algorithm; output ``t`` on ``devices[t]``."""
        outs = list(self.algorithm(list(values), op="sum"))
        if len(outs) != len(values):
            raise ValueError(f"algorithm returned {len(outs)} outputs for {len(values)} values")
        return outs

    def per_tower(self, fn: Callable[[int], Any]) -> list[Any]:
        """``[fn(tower) for tower]``, each call under that tower's device (local work)."""
        out = []
        for t, device in enumerate(self.devices):
            with tf.device(device):
                out.append(fn(t))
        return out

    def gather(self, values: Sequence[tf.Tensor], dst: int) -> list[tf.Tensor]:
        """Every tower's value on tower ``dst``, in tower order (one send per other tower)."""
        return [send(v, self.devices[dst], note="gather") for v in values]

    def decode(self, fn: Callable[[int], tf.Tensor]) -> list[tf.Tensor]:
        """Run ``fn(tower)`` on each decoder tower; copy decoder 0's result to the rest."""
        done = {}
        for t in self.decoders:
            with tf.device(self.devices[t]):
                done[t] = fn(t)
        first = done[self.decoders[0]]
        return [done[t] if t in done else send(first, d, note="decoded")
                for t, d in enumerate(self.devices)]
