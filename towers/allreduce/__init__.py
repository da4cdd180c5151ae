"""All-reduce algorithms built by hand from explicit cross-device copies.

:data:`ALGORITHMS` maps a name to its :class:`Record`; ``ALGORITHMS[name]()`` builds it with
its defaults. :func:`all_reduce` is the entry point; :func:`get` resolves a name.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.bruck import bruck
from towers.allreduce.bucketed import bucketed, grouped, pack, unpack
from towers.allreduce.codecs import CODECS, bf16, fp16, register_codec, topk
from towers.allreduce.collectives import (
    COLLECTIVE_ALGORITHMS,
    all_gather,
    all_to_all,
    broadcast,
    reduce_scatter,
)
from towers.allreduce.compressed import compressed
from towers.allreduce.double_binary_tree import double_binary_tree
from towers.allreduce.halving_doubling import halving_doubling
from towers.allreduce.hierarchical import hierarchical
from towers.allreduce.machinery.base import (
    ALL_OPS,
    OPS,
    AllReduce,
    GradientReducer,
    as_written,
    check_scale,
    check_values,
    combine,
    finish,
    scale,
)
from towers.allreduce.machinery.packed import per_tower
from towers.allreduce.machinery.primitives import Recorder, Transfer, record, send
from towers.allreduce.machinery.registry import (
    ALGORITHMS,
    Algorithm,
    Configured,
    Record,
    Registry,
    register,
)
from towers.allreduce.machinery.resolve import get
from towers.allreduce.machinery.scheduled import run_schedule, scheduled
from towers.allreduce.machinery.sparse import densify, gather_indexed_slices
from towers.allreduce.naive import naive, noop
from towers.allreduce.nccl import nccl, nccl_ring, nccl_tree
from towers.allreduce.parameter_device import parameter_device
from towers.allreduce.pat import pat
from towers.allreduce.powersgd import powersgd
from towers.allreduce.ring import ring
from towers.allreduce.swing import swing
from towers.allreduce.torus_2d import torus_2d
from towers.allreduce.tree import tree
from towers.guard.arguments import check_choice

__all__ = ["ALGORITHMS", "CODECS", "COLLECTIVE_ALGORITHMS", "OPS", "Algorithm", "AllReduce",
           "Configured", "GradientReducer", "Record", "Recorder", "Registry", "Transfer",
           "all_gather", "all_reduce", "all_to_all", "as_written", "bf16", "broadcast", "bruck",
           "bucketed", "check_values", "combine", "compressed", "double_binary_tree", "finish",
           "fp16", "get", "grouped", "halving_doubling", "hierarchical", "naive", "nccl",
           "nccl_ring", "nccl_tree", "noop", "pack", "parameter_device", "pat", "powersgd",
           "record", "reduce_scatter", "register", "register_codec", "ring", "run_schedule",
           "scheduled", "send", "swing", "topk", "torus_2d", "tree", "unpack"]


def all_reduce(
    values: Sequence[tf.Tensor | tf.IndexedSlices],
    algorithm: str | AllReduce = "parameter_device",
    op: str = "sum",
    *,
    devices: Sequence[str] | None = None,
    sparse: str = "gather",
    prescale: float = 1.0,
    postscale: float = 1.0,
) -> list[tf.Tensor | tf.IndexedSlices]:
    """All-reduce one value per tower with ``algorithm``; output ``i`` is on ``values[i]``'s device.

    Args:
        values: one tensor (or ``tf.IndexedSlices``) per tower, same shape and dtype.
        algorithm: a registry name (see ``towers.ALGORITHMS``) or an algorithm callable.
        op: ``"sum"``, ``"mean"`` (not for integers), ``"max"``, ``"min"`` or ``"product"``.
        devices: place ``values[i]`` on ``devices[i]`` first (``tf.function`` arguments).
        sparse: for ``IndexedSlices``: ``"gather"`` (concatenate in tower order, as
            MirroredStrategy does) or ``"densify"`` (dense all-reduce).
        prescale: each value is multiplied by it, in its own dtype, before the reduction
            (Horovod's ``prescale_factor``: ``1/n`` keeps an fp16 sum from overflowing).
        postscale: each output is multiplied by it, in its dtype, after the reduction.
            A factor is a finite number; an integer dtype takes only an integer factor.
    """
    if not isinstance(values, Sequence):  # a tensor or an array is none
        raise TypeError("values must be a list with one tensor per tower (output i goes to "
                        f"values[i]'s device), got {type(values).__name__}")
    check_choice("op", op, ALL_OPS)
    try:
        fn = get(algorithm)
    except (TypeError, ValueError) as err:  # its message speaks of TowerTrainer's all_reduce
        raise type(err)(f"algorithm: {err}") from None
    if devices is not None:
        values = _place(values, devices)
    if not isinstance(sparse, str) or sparse not in ("gather", "densify"):
        raise ValueError(f"sparse must be 'gather' or 'densify', got {sparse!r}")
    dtype = getattr(values[0], "dtype", tf.float32) if values else tf.float32
    pre, post = check_scale("prescale", prescale, dtype), check_scale("postscale", postscale, dtype)
    if pre != 1:
        check_values(values, op)
        values = [scale(v, pre) for v in values]
    return [scale(v, post) for v in _reduce(fn, values, algorithm, op, sparse)]


def _place(values: Sequence[tf.Tensor | tf.IndexedSlices], devices: Sequence[str]
           ) -> list[tf.Tensor | tf.IndexedSlices]:
    """``values[i]`` placed on ``devices[i]`` (checked to be a list of names, one per value)."""
    if (isinstance(devices, str) or not isinstance(devices, Sequence)
            or not all(isinstance(d, str) for d in devices)):  # fmt: skip
        raise TypeError(f"devices must be None or a list of device names, got {devices!r}")
    if len(devices) != len(values):
        raise ValueError(f"devices has {len(devices)} entries for {len(values)} values")
    return per_tower(devices, lambda i: values[i] if isinstance(values[i], tf.IndexedSlices)
                     else tf.identity(values[i]))


def _reduce(fn: AllReduce, values: Sequence[tf.Tensor | tf.IndexedSlices],
            algorithm: object, op: str, sparse: str) -> list[tf.Tensor | tf.IndexedSlices]:
    """Run ``fn`` on dense values, or reduce ``IndexedSlices`` by ``sparse``'s rule."""
    kinds = {isinstance(v, tf.IndexedSlices) for v in values}
    if kinds == {True}:
        devs = check_values(values, op)
        if sparse == "densify":
            return list(densify(fn, values, devs, op))
        return list(gather_indexed_slices(values, devs, op))
    if len(kinds) > 1:
        raise ValueError("values mix dense tensors and IndexedSlices: make them all one kind")
    try:
        out = fn(list(values), op=op)
    except TypeError as err:  # e.g. a callable that is no algorithm(values, *, op)
        message = f"algorithm {algorithm!r}: algorithm(values, op={op!r}) failed: {err}"
        raise TypeError(message) from err
    if len(out) != len(values):
        raise ValueError(f"algorithm returned {len(out)} outputs for {len(values)} values")
    return list(out)
