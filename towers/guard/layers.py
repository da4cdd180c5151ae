"""Layers a trainer cannot run as written, refused by name when the trainer is built.

Two kinds, both checked before any replica, variable or reducer state exists:

- a layer that talks to the distribution strategy: ``BatchNormalization(synchronized=True)``
  all-reduces its batch statistics through ``tf.distribute``'s replica context, and the
  towers run each tower's forward on its own, so with more than one tower it would
  silently normalize each tower's shard alone;
- ``variables="sharded"`` with a layer whose gradient is sparse (``Embedding``: an
  ``IndexedSlices`` with duplicate rows) and an optimizer whose sparse and dense updates
  differ: a shard owner updates a dense slice, so the step would apply the dense update
  where one device and MirroredStrategy apply the sparse one. Whether they differ is
  measured (:func:`sparse_equals_dense`), not listed, so every optimizer is classified
  by what it does.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["check_layers", "sparse_equals_dense"]


def _layers(model: Any) -> list[Any]:
    """Every layer of ``model``, nested sub-models' included (and the model itself)."""
    flatten = getattr(model, "_flatten_layers", None)
    return list(flatten(include_self=True, recursive=True)) if flatten else []


def _check_synchronized(model: Any, towers: int) -> None:
    if towers < 2:
        return
    for layer in _layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.synchronized:
            raise ValueError(
                f"layer {layer.name!r} is BatchNormalization(synchronized=True), which "
                f"all-reduces its batch statistics through tf.distribute's replica context; "
                f"the towers run each tower's forward on its own, so over {towers} towers it "
                "would normalize each tower's shard alone; use synchronized=False (each tower "
                "normalizes its own shard, as MirroredStrategy does without it) or one tower")


def sparse_equals_dense(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether ``optimizer``'s update from an ``IndexedSlices`` gradient with duplicate
    rows equals, bitwise, its update from the densified sum — measured: two fresh
    optimizers of the same config apply the two forms twice to two copies of a 4×2
    variable (rows 1 and 3 get no gradient). The rule is measured, not the rounding of
    the duplicate rows' sum: values and a numeric learning rate are dyadic (0.5), so
    SGD's ``v - lr·g₁ - lr·g₂`` and ``v - lr·(g₁ + g₂)`` are both exact. An optimizer
    that cannot be rebuilt from its config counts as different."""
    config = optimizer.get_config()
    if isinstance(config.get("learning_rate"), float):
        config["learning_rate"] = 0.5
    try:
        fresh = [type(optimizer).from_config(dict(config)) for _ in range(2)]
    except Exception:  # a custom optimizer without a round-tripping config: not measurable
        return False
    start = np.arange(1, 9, dtype="float32").reshape(4, 2) / 8
    sparse = tf.IndexedSlices(tf.constant([[0.5, -0.25], [0.75, 0.5], [-0.25, 1.0]]),
                              tf.constant([0, 0, 2]), tf.constant([4, 2]))  # fmt: skip
    dense = tf.convert_to_tensor(sparse)
    with tf.init_scope():
        results = []
        for opt, grad in zip(fresh, (sparse, dense), strict=True):
            variable = keras.Variable(start, name="probe")
            for _ in range(2):
                opt.apply_gradients([(grad, variable)])
            results.append(np.asarray(variable.numpy()))
    return bool(np.array_equal(results[0], results[1]))


def _sparse_layers(model: Any) -> list[str]:
    """Names of the layers whose trainable variable gets an ``IndexedSlices`` gradient."""
    return [layer.name for layer in _layers(model)
            if isinstance(layer, keras.layers.Embedding) and layer.trainable]


def check_layers(model: Any, optimizer: Any, towers: int, variables: str,
                 sparse: str | None) -> None:  # fmt: skip
    """Refuse the layers this trainer cannot run as written (see the module doc).

    Args:
        sparse: the ``sparse`` argument as given (None: unset). ``sparse="densify"``
            asked for explicitly is the user's choice of the dense update, and accepted.

    Raises:
        ValueError: ``BatchNormalization(synchronized=True)`` over more than one tower; or
            ``variables="sharded"`` with a sparse-gradient layer, an optimizer whose
            sparse and dense updates differ and ``sparse`` unset (the message names all
            three).
    """
    _check_synchronized(model, towers)
    if variables != "sharded" or sparse is not None:
        return
    layers = _sparse_layers(model)
    if layers and not sparse_equals_dense(optimizer):
        raise ValueError(
            f"variables='sharded' with layers {layers} (Embedding: a sparse IndexedSlices "
            f"gradient) and optimizer {type(optimizer).__name__} is refused: a shard owner "
            "updates a dense slice, so the embedding would get the optimizer's dense update, "
            f"and {type(optimizer).__name__}'s update of a sparse gradient with repeated rows "
            "differs from its dense update (measured); use variables='replicated' (keeps the "
            "gradient sparse), an optimizer whose sparse and dense updates agree (SGD, Lion), "
            "or pass sparse='densify' to choose the dense update (then equal to "
            "variables='replicated' with sparse='densify')")
