"""Small reproducible models, per-tower gradients and Hypothesis strategies of step batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

from towers.guard.arguments import check_choice, positive_int
from towers.split import shard_sizes
from towers.tower import tower_step
from towers.training.losses import resolve_loss

__all__ = ["FAMILIES", "ModelSpec", "loss_fn", "per_tower_gradients", "step_batches", "step_cases"]

FAMILIES = ("dense", "conv", "embedding", "batchnorm", "dropout", "regularized")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A small model of one family, reproducible from ``seed``."""

    family: str
    width: int = 4
    classes: int = 3
    seed: int = 0

    def _init(self, k: int) -> keras.initializers.Initializer:
        return keras.initializers.GlorotUniform(seed=self.seed * 101 + k)

    def _body(self) -> tuple[keras.KerasTensor, keras.KerasTensor]:
        init = self._init
        if self.family == "conv":
            inp = keras.Input((6, 6, 1))
            h = keras.layers.Conv2D(2, 3, activation="relu", kernel_initializer=init(0))(inp)
            return inp, keras.layers.Flatten()(h)
        if self.family == "embedding":
            inp = keras.Input((4,), dtype="int32")
            h = keras.layers.Embedding(6, self.width, embeddings_initializer=init(0))(inp)
            return inp, keras.layers.Flatten()(h)
        inp = keras.Input((5,))
        reg = keras.regularizers.L2(0.05) if self.family == "regularized" else None
        h = keras.layers.Dense(self.width, activation="tanh", kernel_initializer=init(0),
                               kernel_regularizer=reg)(inp)
        if self.family == "batchnorm":
            h = keras.layers.BatchNormalization(momentum=0.5)(h)
        if self.family == "dropout":
            h = keras.layers.Dropout(0.5, seed=self.seed)(h)
        return inp, h

    def build(self) -> keras.Model:
        """A fresh, built model; two calls give bitwise-identical weights."""
        check_choice("family", self.family, FAMILIES)
        inp, h = self._body()
        out = keras.layers.Dense(self.classes, kernel_initializer=self._init(1))(h)
        return keras.Model(inp, out)

    def batch(self, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """A batch ``(x, y)`` of ``size`` examples for this model (integer class labels)."""
        rng = np.random.default_rng(seed)
        if self.family == "conv":
            x = rng.normal(size=(size, 6, 6, 1)).astype("float32")
        elif self.family == "embedding":
            # A vocabulary of 6 over 4 positions: duplicate ids within and across towers.
            x = rng.integers(0, 6, size=(size, 4)).astype("int32")
        else:
            x = rng.normal(size=(size, 5)).astype("float32")
        y = rng.integers(0, self.classes, size=(size,)).astype("int32")
        return x, y


def loss_fn() -> keras.losses.Loss:
    """The loss every case uses: sparse categorical cross-entropy on logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def per_tower_gradients(model: keras.Model, x: np.ndarray, y: np.ndarray, devices: Sequence[str],
                        loss: keras.losses.Loss | None = None) -> list[list[np.ndarray]]:
    """Each tower's dense gradient of its share of the global mean loss, ``grads[tower][var]``,
    to size error bounds; one device per example gives the per-example gradients."""
    fn = resolve_loss(loss or loss_fn())
    trainable = [tf.convert_to_tensor(v.value) for v in model.trainable_variables]
    frozen = [tf.convert_to_tensor(v.value) for v in model.non_trainable_variables]
    bounds = np.cumsum([0, *shard_sizes(len(x), len(devices))])
    out = []
    for d, a, b in zip(devices, bounds[:-1], bounds[1:]):
        if a == b:
            out.append([np.zeros(v.shape, "float32") for v in model.trainable_variables])
            continue
        result = tower_step(model, trainable, frozen, (x[a:b], y[a:b], None), loss_fn=fn,
                            global_batch=tf.constant(len(x)), num_towers=len(devices), device=d)
        out.append([np.asarray(tf.convert_to_tensor(g)) for g in result.grads])
    return out


Batches = list[tuple[np.ndarray, np.ndarray]]


def step_batches(features: int, classes: int, *, steps: int = 2,
                 max_batch: int = 12) -> st.SearchStrategy[Batches]:  # fmt: skip
    """Hypothesis: ``steps`` batches ``(x [b, features] float32 in [-1, 1], y [b] int32)``,
    sizes in 1..``max_batch`` (uneven splits, empty towers), values from a drawn seed."""
    for name, value in zip(("features", "classes", "steps", "max_batch"),
                           (features, classes, steps, max_batch), strict=True):
        positive_int(name, value)

    def make(sizes: list[int], seed: int) -> Batches:
        rng = np.random.default_rng(seed)
        return [(rng.uniform(-1, 1, (b, features)).astype("float32"),
                 rng.integers(0, classes, b).astype("int32")) for b in sizes]  # fmt: skip

    sizes = st.lists(st.integers(1, max_batch), min_size=steps, max_size=steps)
    return st.builds(make, sizes, st.integers(0, 2**31 - 1))


def step_cases(features: int, classes: int, *, max_towers: int = 4, steps: int = 2,
               max_batch: int = 12) -> st.SearchStrategy[tuple[int, list[Any]]]:  # fmt: skip
    """Hypothesis: ``(towers, batches)``, a tower count in 1..``max_towers`` and
    :func:`step_batches`, for ``assert_steps_match(a(n), b(n), batches)``."""
    positive_int("max_towers", max_towers)
    batches = step_batches(features, classes, steps=steps, max_batch=max_batch)
    return st.tuples(st.integers(1, max_towers), batches)
