"""Small real data for examples: scikit-learn's bundled 8×8 digits (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from towers.guard.arguments import positive_int

__all__ = ["batches", "digits"]


def digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, ...]:
    """``(x_train, y_train, x_test, y_test)``: 8×8×1 float32 images in [0, 1], int32 labels."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images / 16.0).astype("float32")[..., None]
    y = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    cut = round(len(x) * (1.0 - test_fraction))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def batches(x: np.ndarray, y: np.ndarray, batch_size: int,
            seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One epoch of shuffled batches; the last may be smaller (uneven over towers)."""
    positive_int("batch_size", batch_size)
    order = np.random.default_rng(seed).permutation(len(x))
    for start in range(0, len(x), batch_size):
        idx = order[start : start + batch_size]
        yield x[idx], y[idx]
