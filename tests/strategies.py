"""Hypothesis strategies of optimizers and training cases that only this repository's tests use."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import keras
import numpy as np
from hypothesis import strategies as st

from towers.split import shard_sizes
from towers.testing import FAMILIES, ModelSpec

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
