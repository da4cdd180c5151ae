"""Check a batch against the model, then split it over towers exactly as
``tf.distribute.MirroredStrategy`` does.

Every tower takes ``c = ceil(B / n)`` examples until the batch runs out (TF 2.21)::

    B = 10, n = 4  ->  [3, 3, 3, 1]
    B =  3, n = 4  ->  [1, 1, 1, 0]      (an empty shard)

so tower ``i`` takes rows ``[min(i*c, B), min((i+1)*c, B))``: the same per-shard arithmetic
as the reference, which makes bitwise comparisons possible. Before that,
:func:`batch_tensors` refuses a batch that does not fit the model with an error naming
the argument (docs/bad_inputs.md), never a raw error from the traced step.
:func:`shard_batch` cuts inside
the step; :func:`distribute` cuts a ``tf.data.Dataset`` in tf.data and prefetches every shard
onto its tower (``experimental_distribute_dataset``)::

    batches ─▶ flat_map: shard_0 … shard_{n-1} ─▶ MultiDeviceIterator: buffers on d_0 … d_{n-1}
                                                   next() ─▶ Shards ─▶ train_step_shards
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops.multi_device_iterator_ops import MultiDeviceIterator

from towers.guard.arguments import check_choice, non_negative_int, positive_int
from towers.guard.given import check_dataset, check_devices

__all__ = ["PIPELINES", "Batch", "DistributedDataset", "Shards", "batch_size", "batch_tensors",
           "batch_unknown", "check_batch_against_model", "concat", "distribute",
           "relaxes", "shard_batch", "shard_bounds", "shard_sizes", "split"]

Batch = tuple[Any, Any, Any]
"""``(x, y, sample_weight)``: ``y`` and ``sample_weight`` may be None."""


def shard_sizes(batch: int, n: int) -> list[int]:
    """Python-side shard sizes for a batch of ``batch`` examples over ``n`` towers."""
    batch, n = non_negative_int("batch", batch), positive_int("n", n)
    per = -(-batch // n)
    return [max(0, min(per, batch - i * per)) for i in range(n)]


def batch_size(structure: Any) -> tf.Tensor:
    """The common leading dimension of every tensor in ``structure`` (an int32 scalar).

    Raises:
        ValueError: a scalar, or static leading dimensions that differ.
    """
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]
    if not leaves:
        raise ValueError("the batch is empty: expected at least one tensor")
    static = {}
    for i, t in enumerate(leaves):
        if t.shape.rank == 0:
            raise ValueError(f"batch element {i} is a scalar: every input needs a batch dimension")
        if t.shape.rank is not None and t.shape[0] is not None:
            static[i] = int(t.shape[0])
    if len(set(static.values())) > 1:
        raise ValueError(
            "inputs must share their leading (batch) dimension, got sizes "
            + ", ".join(f"element {i}: {b}" for i, b in static.items())
        )
    return tf.shape(leaves[0], out_type=tf.int32)[0]


def batch_unknown(element_spec: Any) -> bool:
    """Whether some tensor of ``element_spec`` has an unknown leading dimension."""
    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and (shape.rank is None or (shape.rank > 0 and shape[0] is None)):
            return True
    return False


def relaxes(batch_unknown: bool, x: Any, towers: int) -> bool:
    """Whether a step on ``x`` is traced with the batch dimension unknown
    (:mod:`towers.compile.relaxed`): it is unknown to Keras and no tower is empty (empty
    towers need the static trace, which skips them)."""
    if not batch_unknown:
        return False
    size = tf.get_static_value(batch_size(x))
    return size is not None and 0 not in shard_sizes(int(size), towers)


def shard_bounds(batch: tf.Tensor, n: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """``(start, stop)`` of each tower's rows, as int32 tensors (works with unknown ``batch``)."""
    per = (batch + (n - 1)) // n
    return [(tf.minimum(i * per, batch), tf.minimum((i + 1) * per, batch)) for i in range(n)]


def split(structure: Any, n: int) -> list[Any]:
    """Split every tensor of a nested structure along axis 0 into ``n`` shards.

    Returns ``n`` structures of the same nesting, shard ``i`` for tower ``i`` (empty when
    the batch has fewer than ``n`` examples).

    Example:
        >>> [int(s.shape[0]) for s in split(tf.zeros([10, 2]), 4)]
        [3, 3, 3, 1]
    """
    positive_int("n", n)
    batch = batch_size(structure)
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]
    return [tf.nest.pack_sequence_as(structure, [t[start:stop] for t in leaves])
            for start, stop in shard_bounds(batch, n)]


class Shards(NamedTuple):
    """A global batch cut into one ``(x, y, sample_weight)`` piece per tower: a nest of
    tensors (it crosses a ``tf.function`` boundary) whose static shapes tell an empty tower
    at trace time; ``global_batch`` is the whole batch's size (int32)."""

    parts: tuple[Batch, ...]
    global_batch: tf.Tensor

    @property
    def sizes(self) -> list[int | None]:
        """Examples per tower, or None where the size is only known when the step runs."""
        return [tf.TensorShape(tf.nest.flatten(p[0])[0].shape)[0] for p in self.parts]


# -- the batch checked against the model, before anything is traced ---------------------

_NUMERIC = "biuf"  # NumPy dtype kinds a model and a loss can take


def _checked_leaf(name: str, leaf: Any, allow_strings: bool = False) -> tuple:
    """A batch element's shape, once its kind and dtype are checked (a tensor is not
    converted): dense, one batch, numbers (strings where allowed)."""
    if isinstance(leaf, tf.RaggedTensor):
        raise TypeError(f"{name} is a tf.RaggedTensor: pad it to a dense tensor (.to_tensor())")
    if isinstance(leaf, tf.SparseTensor):
        raise TypeError(f"{name} is a tf.SparseTensor: densify it (tf.sparse.to_dense)")
    if isinstance(leaf, (tf.Tensor, tf.Variable)):
        dtype, shape = leaf.dtype, tuple(leaf.shape)
        kind = ("S" if dtype == tf.string else "b" if dtype.is_bool else "i" if dtype.is_integer
                else "f" if dtype.is_floating else "O")  # fmt: skip
    elif isinstance(leaf, (tf.data.Dataset, Iterator)) or callable(leaf):
        raise TypeError(
            f"{name} must be arrays or tensors (one batch); got {type(leaf).__name__}: "
            "use towers.TowerModel.fit for a dataset or a generator"
        )
    else:
        try:
            array = np.asarray(leaf)
        except ValueError as err:  # NumPy refuses rows of different lengths
            raise ValueError(f"{name} is ragged (rows of different lengths): pad it ({err})"
                             ) from err  # fmt: skip
        dtype, shape, kind = array.dtype, array.shape, str(array.dtype.kind)
    if kind not in _NUMERIC and not (kind in "SU" and allow_strings):
        what = "strings" if kind in "SU" else f"dtype {dtype}"
        raise TypeError(
            f"{name} holds {what}: expected numbers (booleans, integers or floats)"
            + ("; encode strings first, e.g. keras.layers.StringLookup" if kind in "SU" else "")
        )
    return shape


def _model_io(model: keras.Model, which: str) -> Any:
    """The model's ``"input"`` or ``"output"`` structure of KerasTensors, or None (a
    subclassed model)."""
    try:
        return getattr(model, which)
    except (AttributeError, ValueError):
        return None


def _check_x(x: Any, model: keras.Model) -> None:
    expected = _model_io(model, "input")
    if expected is None:
        return
    if isinstance(expected, dict):
        if not isinstance(x, dict):
            raise ValueError(
                f"x must be a dict with keys {sorted(expected)}; got {type(x).__name__}"
            )
        missing, extra = sorted(set(expected) - set(x)), sorted(set(x) - set(expected))
        if missing:
            raise ValueError(f"x is missing the model's input(s) {missing}; it has {sorted(x)}")
        if extra:
            raise ValueError(f"x has key(s) {extra} the model has no input for; inputs: "
                             f"{sorted(expected)}")  # fmt: skip
        pairs = [(f"x[{k!r}]", x[k], expected[k]) for k in sorted(expected)]
    else:
        flat = tf.nest.flatten(expected)
        # a list is one array per input, except a plain nested list for a one-input model
        listed = isinstance(x, (list, tuple)) and (
            len(flat) > 1 or all(hasattr(leaf, "shape") for leaf in x)
        )
        leaves = list(x) if listed else [x]
        if len(leaves) != len(flat):
            raise ValueError(f"x has {len(leaves)} arrays; the model takes {len(flat)} input(s)")
        one = not listed
        pairs = [
            ("x" if one else f"x[{i}]", leaf, t) for i, (leaf, t) in enumerate(zip(leaves, flat))
        ]
    for name, leaf, tensor in pairs:
        shape = _checked_leaf(name, leaf, allow_strings=tensor.dtype == "string")
        want = tuple(tensor.shape)
        if len(shape) != len(want) or any(w is not None and w != s for s, w in
                                          zip(shape[1:], want[1:])):  # fmt: skip
            raise ValueError(
                f"{name} has shape {list(shape)}; the model's input {tensor.name!r} takes "
                f"{['batch', *want[1:]]}"
            )


def check_batch_against_model(x: Any, y: Any, sample_weight: Any, model: keras.Model) -> None:
    """Check a step's batch before it is traced: present, numeric, dense, fitting the model.

    Raises:
        TypeError: a ragged or sparse tensor, strings or objects where numbers are
            needed, a dataset or generator instead of one batch, a dict of sample weights.
        ValueError: ``x`` or ``y`` is None or empty; a dict input missing a key (or with an
            extra one); a feature shape, rank or input count that does not fit the model;
            ``y`` a dict for a model with one output.
    """
    if x is None:
        raise ValueError("x is None: pass the batch's inputs (arrays or tensors)")
    if y is None:
        raise ValueError("y is None: train_step needs the targets the loss compares with")
    if isinstance(x, dict) or _model_io(model, "input") is not None:
        _check_x(x, model)
    else:
        for i, leaf in enumerate(tf.nest.flatten(x)):
            _checked_leaf(f"x[{i}]", leaf, allow_strings=True)
    output = _model_io(model, "output")
    outputs = len(output) if isinstance(output, dict | list | tuple) else 1
    # Keras's per-output forms, a dict or one array per output (fit(..., sample_weight=[w_a,
    # w_b])): refused, not read as one [outputs, batch] array (a batch-size or TF error)
    per_output = "a dict" if isinstance(sample_weight, dict) else (
        f"a {type(sample_weight).__name__} of {outputs} arrays, one per output"
        if outputs > 1 and isinstance(sample_weight, list | tuple)
        and len(sample_weight) == outputs
        and all(isinstance(w, list | tuple) or len(getattr(w, "shape", ())) >= 1
                for w in sample_weight) else None)  # fmt: skip
    if per_output:
        raise TypeError(f"sample_weight must be an array (one weight per example), got "
                        f"{per_output}: per-output sample weights are not supported; one array "
                        "weighs every output's loss")
    if isinstance(y, dict) and output is not None and not isinstance(output, dict | list | tuple):
        raise ValueError(f"y is a dict (keys {sorted(y, key=str)}); the model has one output")
    for name, part in (("y", y), ("sample_weight", sample_weight)):
        if part is None:
            continue
        leaves = tf.nest.flatten(part)
        if not leaves:
            raise ValueError(f"{name} is empty ({part!r}): expected arrays or tensors")
        for i, leaf in enumerate(leaves):
            label = name if len(leaves) == 1 else f"{name}[{i}]"
            _checked_leaf(label, leaf)


def batch_tensors(
    x: Any, y: Any, sample_weight: Any, model: keras.Model, *, allow_empty: bool = False
) -> tuple[Any, Any, Any]:
    """A step's batch, checked (:func:`check_batch_against_model`; ``x``, ``y`` and
    ``sample_weight`` of one batch size, non-zero unless ``allow_empty``) and converted to
    tensors; ``sample_weight`` takes the model's float dtype.

    Raises:
        ValueError: as :func:`check_batch_against_model`; batch sizes that differ, a part
            that is a scalar, or an empty batch.
    """
    check_batch_against_model(x, y, sample_weight, model)
    parts = {"x": x, "y": y, "sample_weight": sample_weight}
    dims: dict[str, set[int]] = {}  # static leading dimensions (unknown ones skipped)
    for name, part in parts.items():
        for t in [] if part is None else tf.nest.flatten(part):
            shape = tf.TensorShape(getattr(t, "shape", np.shape(t)))
            if shape.rank == 0:
                raise ValueError(f"{name} has a scalar where a batch was expected")
            known = shape.rank is not None and shape[0] is not None
            dims.setdefault(name, set()).update([int(shape[0])] if known else [])
    all_sizes = set().union(*dims.values())
    if len(all_sizes) > 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in dims.items())
        raise ValueError(f"x, y and sample_weight must share their batch size; got {detail}")
    if all_sizes == {0} and not allow_empty:
        raise ValueError("the batch is empty: x has 0 examples")
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    if sample_weight is not None:
        dtype = tf.as_dtype(model.trainable_variables[0].dtype)
        sample_weight = tf.convert_to_tensor(sample_weight, dtype=dtype)
    return x, y, sample_weight


def shard_batch(x: Any, y: Any, sample_weight: Any, n: int) -> Shards:
    """Cut a batch into ``n`` :class:`Shards`: Python slices (static sizes) when the batch
    size is static, else :func:`split` at run time."""
    batch = (x, y, sample_weight)
    present = tuple(part for part in batch if part is not None)
    static = tf.TensorShape(tf.nest.flatten(x)[0].shape)[0]
    if static is None:
        pieces = split(present, n)
    else:
        per = -(-int(static) // n)  # as shard_sizes: ceil(B / n) each until B runs out
        bounds = [min(i * per, int(static)) for i in range(n + 1)]
        leaves = tf.nest.flatten(present)
        pieces = [tf.nest.pack_sequence_as(present, [t[a:b] for t in leaves])
                  for a, b in itertools.pairwise(bounds)]  # fmt: skip
    parts: list[Batch] = []
    for piece in pieces:
        it = iter(piece)
        x_i, y_i, w_i = (None if part is None else next(it) for part in batch)
        parts.append((x_i, y_i, w_i))
    return Shards(tuple(parts), tf.shape(tf.nest.flatten(x)[0], out_type=tf.int32)[0])


def concat(parts: list[Any], device: str) -> Any:
    """Undo a split: concatenate per-tower outputs on ``device``, in tower order."""
    columns = zip(*(tf.nest.flatten(p) for p in parts))  # each leaf, in tower order
    with tf.device(device):
        return tf.nest.pack_sequence_as(parts[0], [tf.concat(c, 0) for c in columns])


PIPELINES = ("multi_device", "per_device")
"""How :func:`distribute` moves shards to the towers: ``multi_device`` reads the source once
and deals the shards with one ``MultiDeviceIterator``; ``per_device`` runs one
``prefetch_to_device`` iterator per tower, each reading the source (which must then yield
the same batches every time: no unseeded shuffle)."""


def _shard_of(element: tuple[Any, ...], tower: tf.Tensor, n: int) -> tuple[Any, ...]:
    """Tower ``tower``'s rows of every tensor in ``element`` (the rule of :func:`split`)."""
    bounds = tf.stack([tf.stack(b) for b in shard_bounds(batch_size(element), n)])
    start, stop = bounds[tower][0], bounds[tower][1]
    return tf.nest.map_structure(lambda t: t[start:stop], element)


@dataclasses.dataclass(frozen=True)
class DistributedDataset:
    """Global batches as :class:`Shards`, ``parts[i]`` on ``devices[i]``; each ``iter()`` is
    one epoch (made by :func:`distribute`)."""

    dataset: tf.data.Dataset
    devices: list[str]
    pipeline: str
    prefetch: int

    def __iter__(self) -> Iterator[Shards]:
        n = len(self.devices)
        if self.pipeline == "multi_device":
            shards = self.dataset.flat_map(
                lambda *e: tf.data.Dataset.range(n).map(lambda i: _shard_of(e, i, n)))
            it = MultiDeviceIterator(shards, self.devices, prefetch_buffer_size=self.prefetch)
            return self._deal(it.get_next)
        iterators = []
        for i, device in enumerate(self.devices):
            mine = self.dataset.map(lambda *e, i=i: _shard_of(e, tf.constant(i, tf.int64), n))
            with tf.device(device):
                iterators.append(iter(mine.apply(
                    tf.data.experimental.prefetch_to_device(device, self.prefetch))))
        return self._deal(lambda: [next(it) for it in iterators])

    def _deal(self, get_next: Any) -> Iterator[Shards]:
        while True:
            try:
                parts = get_next()
            except (StopIteration, tf.errors.OutOfRangeError):
                return
            total = sum(int(tf.nest.flatten(p)[0].shape[0]) for p in parts)
            padded = tuple((*p, None) if len(p) == 2 else tuple(p) for p in parts)
            yield Shards(padded, tf.constant(total, tf.int32))


def distribute(
    dataset: tf.data.Dataset, devices: Sequence[str], *, pipeline: str = "multi_device",
    prefetch: int = 2,
) -> DistributedDataset:
    """The per-device input pipeline: shards of each global batch, prefetched on their towers.

    Args:
        dataset: a batched ``tf.data.Dataset`` of global batches ``(x, y)`` or
            ``(x, y, sample_weight)`` (an uneven last batch is welcome).
        devices: the towers' devices, in tower order (``trainer.devices``).
        pipeline: ``"multi_device"`` or ``"per_device"`` (:data:`PIPELINES`).
        prefetch: shards buffered on each device ahead of the step.

    Returns:
        A :class:`DistributedDataset` of one :class:`Shards` per global batch, for
        :meth:`towers.TowerTrainer.train_step_shards`.

    Raises:
        TypeError: ``dataset`` is not a Dataset of tensors; ``devices`` not device names.
        ValueError: an unbatched ``dataset``, empty or unknown ``devices``, a bad
            ``pipeline`` or ``prefetch``.

    Example:
        >>> data = tf.data.Dataset.from_tensor_slices((x, y)).batch(256)  # doctest: +SKIP
        >>> for shards in distribute(data, trainer.devices):               # doctest: +SKIP
        ...     loss = trainer.train_step_shards(shards)
    """
    devices = check_devices(devices)
    check_choice("pipeline", pipeline, PIPELINES)
    prefetch = positive_int("prefetch", prefetch)
    check_dataset(dataset)
    return DistributedDataset(dataset, devices, pipeline, prefetch)
