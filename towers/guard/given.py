"""What a trainer is given, checked before any of it is used: devices, ``set_weights``
arrays, a dataset of global batches and its model's layers; each error names the argument."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.devices import canonical_device, local_devices
from towers.guard import capabilities

__all__ = ["check_dataset", "check_devices", "check_layers", "check_weights",
           "sparse_equals_dense"]  # fmt: skip


def check_devices(devices: Sequence[str] | None) -> list[str]:
    """Tower devices (None: every local device) as canonical names (``TypeError`` if not a
    list of strings; ``ValueError``: none, duplicates, or a name TensorFlow does not know)."""
    devices = local_devices() if devices is None else devices
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list of device names, got {devices!r}")
    if not devices:
        raise ValueError("devices is empty: give at least one device (see towers.simulate_devices)")
    known = {canonical_device(d.name) for d in tf.config.list_logical_devices()}
    out: list[str] = []
    for d in devices:
        if not isinstance(d, str):
            raise TypeError(f"devices must hold strings, got {d!r}")
        c = canonical_device(d)
        if c not in known:
            raise ValueError(f"devices: unknown device {d!r}; known: {', '.join(sorted(known))}")
        if c in out:
            raise ValueError(f"devices: {d!r} appears twice; each tower needs its own device")
        out.append(c)
    return out


def check_weights(variables: Sequence[Any], weights: Any) -> list[np.ndarray]:
    """``weights`` as arrays of ``variables``' dtypes, every one checked before any is used
    (each error names the index and variable)."""
    if isinstance(weights, (str, bytes, np.ndarray)) or not isinstance(weights, Sequence):
        raise TypeError(
            f"weights must be a list of arrays (model.weights order), got {weights!r:.80}")
    if len(weights) != len(variables):
        raise ValueError(
            f"weights: expected {len(variables)} arrays (model.weights), got {len(weights)}")
    arrays = []
    for i, (v, w) in enumerate(zip(variables, weights)):
        where = f"weights[{i}] (variable {v.path}, {v.dtype}{list(v.shape)})"
        a = np.asarray(w)
        if a.dtype.kind not in "biuf":
            raise TypeError(f"{where}: expected numbers, got an array of {a.dtype}")
        if a.dtype.kind == "f" and np.dtype(v.dtype).kind in "iub":
            raise TypeError(f"{where}: a float array for an integer variable would be truncated")
        if tuple(a.shape) != tuple(v.shape):
            raise ValueError(f"{where}: got shape {list(a.shape)}")
        arrays.append(a.astype(v.dtype, copy=False))
    return arrays


def check_dataset(dataset: Any) -> None:
    """A ``TypeError`` unless ``dataset`` yields ``(x, y[, sample_weight])`` of dense tensors;
    a ``ValueError`` when it looks unbatched."""
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"dataset must be a tf.data.Dataset of global batches, got "
                        f"{type(dataset).__name__}")  # fmt: skip
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        raise TypeError("dataset's elements must be tuples (x, y) or (x, y, sample_weight), got "
                        f"{type(spec).__name__} {spec!r}"[:300])  # fmt: skip
    dims: set[int] = set()
    for leaf in tf.nest.flatten(spec):
        shape = getattr(leaf, "shape", None)
        if not isinstance(leaf, tf.TensorSpec) or shape is None or shape.rank is None:
            raise TypeError(f"dataset's elements must hold dense tensors of known rank, got {leaf}")
        if shape.rank == 0 or (shape[0] is not None and dims and shape[0] not in dims):
            raise ValueError(f"dataset looks unbatched (element spec {spec}): every part needs "
                             "the batch as its first dimension; batch it first: "
                             "dataset.batch(global_batch_size)")  # fmt: skip
        if shape[0] is not None:
            dims.add(shape[0])


def sparse_equals_dense(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether ``optimizer``'s update from an ``IndexedSlices`` gradient with duplicate rows
    equals, bitwise, its update from the densified sum (measured on dyadic values; one that
    cannot be rebuilt from its config counts as different)."""
    config = optimizer.get_config()
    if isinstance(config.get("learning_rate"), float):
        config["learning_rate"] = 0.5
    try:
        fresh = [type(optimizer).from_config(dict(config)) for _ in range(2)]
    except Exception:  # a custom optimizer without a round-tripping config: not measurable
        return False
    sparse = tf.IndexedSlices(tf.constant([[0.5, -0.25], [0.75, 0.5], [-0.25, 1.0]]),
                              tf.constant([0, 0, 2]), tf.constant([4, 2]))  # fmt: skip
    with tf.init_scope():
        probes = [keras.Variable(np.arange(1, 9, dtype="float32").reshape(4, 2) / 8)
                  for _ in fresh]  # fmt: skip
        for _ in range(2):
            for opt, grad, v in zip(fresh, (sparse, tf.convert_to_tensor(sparse)), probes):
                opt.apply_gradients([(grad, v)])
    return bool(np.array_equal(probes[0].numpy(), probes[1].numpy()))


def check_layers(model: Any, optimizer: Any, towers: int, cell: dict[str, str],
                 sparse: str | None) -> list[str]:  # fmt: skip
    """Refuse the layers this trainer cannot run as written (a ``ValueError``); return the
    names of the ``BatchNormalization(synchronized=True)`` layers the towers synchronize."""
    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=True, recursive=True)) if flatten else []
    synced = [layer.name for layer in layers if towers > 1
              and isinstance(layer, keras.layers.BatchNormalization) and layer.synchronized]
    try:
        if synced:
            capabilities.check({**cell, "batch_norm": "synchronized"})
    except ValueError as refused:
        raise ValueError(f"layers {synced} are BatchNormalization(synchronized=True): "
                         f"{refused}") from None
    if cell["variables"] != "sharded" or sparse is not None:
        return synced
    embeddings = [layer.name for layer in layers
                  if isinstance(layer, keras.layers.Embedding) and layer.trainable]
    if embeddings and not sparse_equals_dense(optimizer):
        name = type(optimizer).__name__
        raise ValueError(
            f"variables='sharded' with layers {embeddings} (Embedding: a sparse IndexedSlices "
            f"gradient) and optimizer {name} is refused: a shard owner updates a dense slice, "
            f"so the embedding would get the optimizer's dense update, and {name}'s update of a "
            "sparse gradient with repeated rows differs from its dense update (measured); use "
            "variables='replicated' (keeps the gradient sparse), an optimizer whose sparse and "
            "dense updates agree (SGD, Lion), or pass sparse='densify' to choose the dense "
            "update (then equal to variables='replicated' with sparse='densify')")
    return synced
