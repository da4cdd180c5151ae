"""Keras metrics for ``fit`` and ``evaluate``: built on the first batch, updated once per batch.

Each batch's outputs are concatenated in tower order and a metric's state is updated
once with ``(y, outputs, sample_weight)``: concatenation does no arithmetic, so the
metric sees exactly what a single-device Keras loop would see for those outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import keras
import tensorflow as tf

__all__ = ["MetricSpec", "Metrics"]

MetricSpec: TypeAlias = "str | keras.metrics.Metric | Callable[..., Any]"


def _accuracy(name: str, y_true: Any, y_pred: Any) -> keras.metrics.Metric:
    """Keras' rule for ``"accuracy"``: binary, sparse categorical or categorical."""
    if y_pred.shape[-1] == 1:
        return keras.metrics.BinaryAccuracy(name=name)
    sparse = y_true.shape.rank < y_pred.shape.rank or y_true.shape[-1] == 1
    if sparse:
        return keras.metrics.SparseCategoricalAccuracy(name=name)
    return keras.metrics.CategoricalAccuracy(name=name)


def _metric(spec: MetricSpec, y_true: Any, y_pred: Any) -> keras.metrics.Metric:
    """A fresh metric for ``spec`` (a caller's Metric object is copied, not updated)."""
    if isinstance(spec, keras.metrics.Metric):
        return type(spec).from_config(spec.get_config())
    if isinstance(spec, str) and spec.lower() in ("accuracy", "acc"):
        return _accuracy(spec, tf.convert_to_tensor(y_true), tf.convert_to_tensor(y_pred))
    try:
        got = keras.metrics.get(spec)
    except (ValueError, TypeError) as err:
        raise ValueError(f"metrics: unknown metric {spec!r}") from err
    if isinstance(got, keras.metrics.Metric):
        return got
    name = spec if isinstance(spec, str) else getattr(spec, "__name__", "metric")
    return keras.metrics.MeanMetricWrapper(got, name=name)


class Metrics:
    """The metrics of one pass over data, built on the first batch (``"accuracy"`` needs
    the shapes), each updated once per batch on the concatenated outputs."""

    def __init__(self, specs: Sequence[MetricSpec] | None) -> None:
        if specs is not None and (
            isinstance(specs, str | bytes) or not isinstance(specs, Sequence)
        ):
            raise ValueError(f"metrics must be a list, got {specs!r}")
        self.specs = list(specs or [])
        self.metrics: list[keras.metrics.Metric] = []
        for spec in self.specs:  # fail before training, not after the first batch
            if isinstance(spec, str) and spec.lower() not in ("accuracy", "acc"):
                _metric(spec, None, None)
            elif not isinstance(spec, str | keras.metrics.Metric) and not callable(spec):
                raise ValueError(f"metrics: unknown metric {spec!r} (a name, Metric or function)")

    def update(self, y: Any, y_pred: Any, sample_weight: Any) -> None:
        if self.specs and not self.metrics:
            self.metrics = [_metric(s, y, y_pred) for s in self.specs]
        for m in self.metrics:
            m.update_state(y, y_pred, sample_weight=sample_weight)

    def results(self) -> dict[str, float]:
        return {m.name: float(m.result()) for m in self.metrics}
