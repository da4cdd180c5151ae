"""Hypothesis strategies of models, optimizers, training cases and batches for equivalence tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from hypothesis import strategies as st

from towers.guard.arguments import check_choice, positive_int
from towers.split import shard_sizes
from towers.tower import tower_step
from towers.training.keras_loss import resolve_loss

__all__ = ["CENTRAL_STORAGE_FAMILIES", "CENTRAL_STORAGE_OPTIMIZERS", "FAMILIES", "OPTIMIZERS",
           "ModelSpec", "TrainingCase", "loss_fn", "model_specs", "no_empty_shards",
           "per_tower_gradients", "step_batches", "step_cases", "training_cases"]

FAMILIES = ("dense", "conv", "embedding", "batchnorm", "dropout", "regularized")

OPTIMIZERS: dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
}
"""Optimizer factories by name (learning rates small enough for 1–3 stable steps)."""

CENTRAL_STORAGE_FAMILIES = ("dense", "conv", "embedding", "regularized")
"""The families CentralStorageStrategy can train: BatchNormalization and Dropout assign
variables in replica context, which it refuses (``reference.central_storage.known_failures``,
checked against these lists by ``tests/reference``)."""
CENTRAL_STORAGE_OPTIMIZERS = ("sgd", "momentum", "adam", "rmsprop")
"""The optimizers CentralStorageStrategy can run (Keras 3 Nadam updates ``u_product``)."""


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


@dataclasses.dataclass(frozen=True)
class TrainingCase:
    """One equivalence scenario: model, optimizer, towers, batches, placement, steps."""

    spec: ModelSpec
    optimizer: str
    towers: int
    batch_sizes: tuple[int, ...]
    placement: str
    data_seed: int = 0

    def batches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The batches of every step, reproducible from ``data_seed``."""
        return [self.spec.batch(b, self.data_seed + k) for k, b in enumerate(self.batch_sizes)]


def no_empty_shards(batch: int, n: int) -> int:
    """The smallest batch ≥ ``batch`` that leaves no tower empty (13 over 8 would not)."""
    batch = max(batch, n)
    while 0 in shard_sizes(batch, n):
        batch += 1
    return batch


def model_specs(families: Sequence[str] = FAMILIES) -> st.SearchStrategy[ModelSpec]:
    """Small models of the given families with random widths and seeds."""
    return st.builds(ModelSpec, family=st.sampled_from(list(families)), width=st.integers(2, 6),
                     classes=st.integers(2, 4), seed=st.integers(0, 1000))


def training_cases(families: Sequence[str] = FAMILIES,
                   optimizers: Sequence[str] = tuple(OPTIMIZERS), max_towers: int = 8,
                   placements: Sequence[str] = ("parameter_device", "replicated"),
                   max_steps: int = 3, max_batch: int = 12, min_towers: int = 1,
                   ) -> st.SearchStrategy[TrainingCase]:  # fmt: skip
    """Scenarios over models, optimizers, ``min_towers``–``max_towers`` towers, uneven batches.

    Batch sizes include sizes no tower count divides and sizes below it (empty shards),
    except for BatchNormalization and Conv2D, which the reference cannot run on an empty
    shard (NaN statistics; Keras 3's Conv2D fails on a batch of 0).
    """

    @st.composite
    def build(draw: st.DrawFn) -> TrainingCase:
        spec = draw(model_specs(families))
        towers = draw(st.integers(min_towers, max_towers))
        sizes = draw(st.lists(st.integers(1, max_batch), min_size=1, max_size=max_steps))
        if spec.family in ("batchnorm", "conv"):
            sizes = [no_empty_shards(b, towers) for b in sizes]
        optimizer = draw(st.sampled_from(list(optimizers)))
        placement = draw(st.sampled_from(list(placements)))
        return TrainingCase(spec, optimizer, towers, tuple(sizes), placement,
                            draw(st.integers(0, 10_000)))

    return build()


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
