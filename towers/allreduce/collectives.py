"""The other collectives: reduce-scatter, all-gather and broadcast, run from schedules.

**Sharding rule.** :func:`reduce_scatter` flattens the reduced value (row-major,
as ``tf.reshape(x, [-1])``) and gives tower ``i`` the ``i``-th of ``n`` runs cut
by :func:`~towers.schedule.collectives.even_sizes`: the first ``L mod n`` runs
have one element more (``numpy.array_split``'s rule; no padding, a shard is
empty when ``L < n``). :func:`all_gather` concatenates per-tower shards along
their first axis in tower order, so ``all_gather(reduce_scatter(v))`` is the
all-reduce, flattened, on every tower. :func:`broadcast` copies one value to
every device. :func:`all_to_all` transposes blocks: tower ``i`` gets block ``i`` of
every tower's value, in tower order.

Each runs a :class:`~towers.schedule.Schedule` from the collectives' registry
(:mod:`towers.allreduce.collective_registry`), or any generator ``n -> Schedule``
for its collective, run by the one interpreter of every schedule,
:func:`towers.allreduce.machinery.scheduled.run_slots` (proved first; ``copy`` replaces
the destination's slot, ``reduce`` computes ``combine(received, own)``; a run is
finished, ``mean`` divides, once, where its last contribution arrives). This
module only cuts the values into slots by the sharding rule and puts the
results together.

Example:
    >>> shards = reduce_scatter(values, algorithm="halving", op="sum")   # doctest: +SKIP
    >>> full = all_gather(shards, algorithm="doubling")                   # doctest: +SKIP
    >>> copies = broadcast(x, devices, root=2, algorithm="chain")         # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from towers.allreduce.collective_registry import collective_algorithm
from towers.allreduce.machinery.base import DTYPES, check_scale, check_values, scale
from towers.allreduce.machinery.primitives import send
from towers.allreduce.machinery.scheduled import Slots, run_slots
from towers.devices import canonical_device
from towers.schedule.collectives import even_sizes, rooted
from towers.schedule.ir import Schedule

__all__ = ["all_gather", "all_to_all", "broadcast", "reduce_scatter"]

Algorithm = str | Callable[[int], Schedule]


def _device(x: tf.Tensor, what: str) -> str:
    """``x``'s canonical device, or an error naming ``what`` (``shards[2]``, ``value``)."""
    device = canonical_device(x.device)
    if not device:
        raise ValueError(f"{what} has no device: create it under tf.device(...) (inside "
                         "tf.function, a slice or argument needs its own tf.device block)")
    return device


def _schedule(collective: str, algorithm: Algorithm, n: int) -> Schedule:
    """The schedule ``algorithm`` names (or generates) for ``n`` towers, checked to fit."""
    if isinstance(algorithm, str):
        generator = collective_algorithm(collective, algorithm).generator
        assert generator is not None  # every collective's record is a schedule
        schedule = generator(n)
    elif callable(algorithm):
        schedule = algorithm(n)
    else:
        raise TypeError(f"algorithm must be a name or a generator n -> Schedule, "
                        f"got {algorithm!r}")
    if not isinstance(schedule, Schedule) or schedule.collective != collective:
        what = getattr(schedule, "collective", type(schedule).__name__)
        raise ValueError(f"algorithm must give a {collective} Schedule, got {what}")
    if schedule.towers != n:
        raise ValueError(f"algorithm gave a schedule for {schedule.towers} towers, not {n}")
    if collective != "broadcast" and schedule.owners != tuple(range(n)):
        raise ValueError(f"algorithm's {collective} schedule must have {n} chunks, chunk i "
                         f"owned by tower i; got owners {schedule.owners}")
    return schedule


def reduce_scatter(values: Sequence[tf.Tensor], *, algorithm: Algorithm = "ring",
                   op: str = "sum", prescale: float = 1.0,
                   postscale: float = 1.0) -> list[tf.Tensor]:
    """Reduce one value per tower and leave tower ``i`` with shard ``i`` of the result.

    Args:
        values: one tensor per tower (static shape, same shape and dtype), each on
            its own device.
        algorithm: ``"ring"`` or ``"halving"`` (any ``n``), or a generator
            ``n -> Schedule`` of a ``reduce_scatter`` with chunk ``i`` owned by tower ``i``.
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``.
        prescale, postscale: multiply each value before, each shard after, the
            reduction, in the values' dtype (as in :func:`towers.all_reduce`).

    Returns:
        ``shards[i]``: a 1-D tensor on ``values[i]``'s device, elements
        ``[start_i, start_i + even_sizes(L, n)[i])`` of the flattened reduction.

    Raises:
        ValueError: bad ``values`` or ``op`` (see ``check_values``), a shape that is not
            static, or an unknown ``algorithm``.
        TypeError: ``values`` not a list of tensors, or ``algorithm`` not a name or callable.

    Example:
        >>> reduce_scatter([a, b], op="sum")   # a, b of 5 elements -> shards of 3 and 2
        ... # doctest: +SKIP
    """
    devices = check_values(values, op)
    pre = check_scale("prescale", prescale, values[0].dtype)
    post = check_scale("postscale", postscale, values[0].dtype)
    for i, v in enumerate(values):
        if not v.shape.is_fully_defined():
            raise ValueError(f"values[{i}] needs a static shape, got {v.shape}")
    n = len(values)
    schedule = _schedule("reduce_scatter", algorithm, n)
    sizes = even_sizes(int(values[0].shape.num_elements()), n)
    slots: Slots = []
    for v, device in zip(values, devices):
        with tf.device(device):
            slots.append(list(tf.split(tf.reshape(scale(v, pre), [-1]), sizes)))
    slots = run_slots(schedule, slots, devices, op, note="reduce_scatter")
    return [scale(slots[i][i], post) for i in range(n)]


def _check_shards(shards: Sequence[tf.Tensor]) -> list[str]:
    """The shards' devices; errors name the shard and what was expected."""
    if isinstance(shards, (tf.Tensor, tf.Variable)) or not isinstance(shards, Sequence):
        raise TypeError("shards must be a list with one tensor per tower")
    if not shards:
        raise ValueError("shards is empty: expected one tensor per tower")
    for i, x in enumerate(shards):
        if not isinstance(x, (tf.Tensor, tf.Variable)):
            raise TypeError(f"shards[{i}] must be a tf.Tensor, got {type(x).__name__}")
        if x.shape.rank == 0:
            raise ValueError(f"shards[{i}] is a scalar: shards are concatenated on axis 0")
        if x.dtype != shards[0].dtype:
            raise ValueError(f"shards differ in dtype: shards[0] is {shards[0].dtype.name}, "
                             f"shards[{i}] {x.dtype.name}")
        if not x.shape[1:].is_compatible_with(shards[0].shape[1:]):
            raise ValueError(f"shards differ beyond axis 0: shards[0] has {shards[0].shape}, "
                             f"shards[{i}] {x.shape}")
    if shards[0].dtype not in DTYPES:
        raise ValueError(f"dtype {shards[0].dtype.name} is not supported; use one of "
                         f"{', '.join(d.name for d in DTYPES)}")
    devices = [_device(x, f"shards[{i}]") for i, x in enumerate(shards)]
    for i, d in enumerate(devices):
        if d in devices[:i]:
            raise ValueError(f"shards[{devices.index(d)}] and shards[{i}] are both on {d}: "
                             "one per device")
    return devices


def all_gather(shards: Sequence[tf.Tensor], *, algorithm: Algorithm = "ring") -> list[tf.Tensor]:
    """Every tower ends with ``concat(shards, axis=0)``: the inverse of :func:`reduce_scatter`.

    Args:
        shards: one tensor per tower (rank >= 1, one dtype, equal beyond axis 0; the
            first axis may differ), each on its own device.
        algorithm: ``"ring"`` or ``"doubling"`` (any ``n``), or a generator
            ``n -> Schedule`` of an ``all_gather`` with chunk ``i`` owned by tower ``i``.

    Returns:
        ``out[i]`` on ``shards[i]``'s device; copies only, so all are bitwise equal.

    Raises:
        ValueError: an empty list, a scalar, differing dtypes or trailing shapes, two
            shards on one device, or an unknown ``algorithm``.
        TypeError: ``shards`` not a list of tensors.

    Example:
        >>> all_gather(reduce_scatter(values))   # the flattened sum on every tower
        ... # doctest: +SKIP
    """
    devices = _check_shards(shards)
    n = len(shards)
    schedule = _schedule("all_gather", algorithm, n)
    slots: Slots = [[x if c == t else None for c in range(n)] for t, x in enumerate(shards)]
    slots = run_slots(schedule, slots, devices, note="all_gather")
    out = []
    for row, device in zip(slots, devices):
        with tf.device(device):
            out.append(tf.concat(row, axis=0))
    return out


def _check_broadcast(value: tf.Tensor, devices: Sequence[str], root: int) -> list[str]:
    if not isinstance(value, (tf.Tensor, tf.Variable)):
        raise TypeError(f"value must be a tf.Tensor, got {type(value).__name__}")
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"devices must be a non-empty list of device names, got {devices!r}")
    names = [canonical_device(d) if isinstance(d, str) else "" for d in devices]
    for i, d in enumerate(names):
        if not d:
            raise ValueError(f"devices[{i}] must be a device name, got {devices[i]!r}")
        if d in names[:i]:
            raise ValueError(f"devices[{names.index(d)}] and devices[{i}] are both {d}")
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < len(names):
        raise ValueError(f"root must be an index into devices [0, {len(names)}), got {root!r}")
    if not value.shape.is_fully_defined():
        raise ValueError(f"value needs a static shape, got {value.shape}")
    if _device(value, "value") != names[root]:  # any dtype: a broadcast only copies
        raise ValueError(f"value is on {_device(value, 'value')}, not on devices[root={root}] "
                         f"{names[root]}: create it there (or pass that root)")
    return names


def broadcast(value: tf.Tensor, devices: Sequence[str], *, root: int = 0,
              algorithm: Algorithm = "tree") -> list[tf.Tensor]:
    """Copy ``value`` from ``devices[root]`` to every device in ``devices``.

    Args:
        value: a tensor with a static shape, on ``devices[root]``.
        devices: the towers' devices, distinct.
        root: the index of the device holding ``value``.
        algorithm: ``"tree"`` (binomial), ``"chain"`` (pipelined, 4 chunks) or
            ``"flat"`` (the root sends to every device in one tick), or a generator
            ``n -> Schedule`` of a ``broadcast`` (its root is turned to ``root``).

    Returns:
        ``out[i]`` on ``devices[i]``, of ``value``'s shape; ``out[root]`` is ``value``.
        Copies only, so all are bitwise equal.

    Raises:
        ValueError: empty or repeated devices, ``root`` out of range, ``value`` not on
            ``devices[root]`` or an unknown ``algorithm``.
        TypeError: ``value`` not a tensor.

    Example:
        >>> copies = broadcast(w, devices, root=0, algorithm="chain")   # doctest: +SKIP
    """
    names = _check_broadcast(value, devices, root)
    schedule = rooted(_schedule("broadcast", algorithm, len(names)), root)
    shape, size = value.shape, int(value.shape.num_elements())
    with tf.device(names[root]):
        pieces = tf.split(tf.reshape(value, [-1]), even_sizes(size, schedule.chunks))
    slots: Slots = [[None] * schedule.chunks for _ in names]
    slots[root] = list(pieces)
    slots = run_slots(schedule, slots, names, note="broadcast")
    out = []
    for i, (row, device) in enumerate(zip(slots, names)):
        with tf.device(device):
            out.append(value if i == root else tf.reshape(tf.concat(row, axis=0), shape))
    return out


def all_to_all(values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Tower ``i``'s output block ``j`` is tower ``j``'s block ``i``: a transpose of blocks.

    Each ``values[i]`` is cut along axis 0 into ``n`` equal blocks of ``m = shape[0] / n``
    rows (block ``j`` = rows ``[j*m, (j+1)*m)``). ``out[i]`` has ``values[i]``'s shape
    and is ``concat([block i of values[0], block i of values[1], ..., block i of
    values[n-1]], axis=0)``: with ``m = 1``, tower ``i``'s output row ``j`` is tower
    ``j``'s row ``i``. Built from :func:`~towers.allreduce.machinery.primitives.send`
    (one tick, every tower sends ``n - 1`` blocks), not from TensorFlow's collective.

    Args:
        values: one tensor per tower (rank >= 1, static shape, same shape and dtype,
            axis 0 a multiple of the tower count), each on its own device.

    Returns:
        ``out[i]`` on ``values[i]``'s device; copies only, so bitwise the blocks sent.

    Raises:
        ValueError: bad ``values`` (see ``check_values``), a scalar, a shape that is not
            static, or an axis 0 that is not a multiple of ``len(values)``.
        TypeError: ``values`` not a list of tensors.

    Example:
        >>> all_to_all([a, b])   # a = [a0, a1], b = [b0, b1] -> [[a0, b0], [a1, b1]]
        ... # doctest: +SKIP
    """
    devices = check_values(values)
    n = len(values)
    for i, v in enumerate(values):
        if not v.shape.is_fully_defined() or v.shape.rank == 0:
            raise ValueError(f"values[{i}] needs a static shape of rank >= 1, got {v.shape}")
    if values[0].shape[0] % n:
        raise ValueError(f"values[0] has {values[0].shape[0]} rows on axis 0, not a multiple "
                         f"of the {n} towers: all_to_all cuts axis 0 into {n} equal blocks")
    blocks = []
    for v, device in zip(values, devices):
        with tf.device(device):
            blocks.append(tf.split(v, n, axis=0))
    out = []
    for i, device in enumerate(devices):
        moved = [send(blocks[j][i], device, tick=0, chunk=j, note="all_to_all")
                 for j in range(n)]
        with tf.device(device):
            out.append(tf.concat(moved, axis=0))
    return out
