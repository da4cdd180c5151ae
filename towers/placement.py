"""Model and optimizer copies, each created under ``tf.device`` where it should live.

A *replica* is one (model, optimizer) pair whose variables sit on one device. The
``parameter_device`` placement has a single replica on the parameter device; the
``replicated`` placement has one per tower. All replicas start bitwise equal:
later copies take every variable (seed-generator state included) from the first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias

import keras
import numpy as np
import tensorflow as tf

from towers.devices import canonical_device

__all__ = ["ModelLike", "OptimizerLike", "Replica", "make_replicas"]

ModelLike: TypeAlias = "keras.Model | Callable[[], keras.Model]"
OptimizerLike: TypeAlias = "keras.optimizers.Optimizer | Callable[[], keras.optimizers.Optimizer]"


@dataclasses.dataclass
class Replica:
    """One copy of the model and its optimizer, living on ``device``."""

    device: str
    model: keras.Model
    optimizer: keras.optimizers.Optimizer


def _on_device(model: keras.Model, device: str) -> bool:
    return all(canonical_device(v.value.device) == device for v in model.variables)


def _new_model(model: ModelLike, device: str, first: keras.Model | None) -> keras.Model:
    with tf.device(device):
        if isinstance(model, keras.Model):
            if first is None and model.built and _on_device(model, device):
                return model
            if not model.built:
                raise ValueError(
                    "model is not built: give it an Input (keras.Input) or call it once, "
                    "or pass a zero-argument factory that returns a built model"
                )
            try:
                made = keras.models.clone_model(model)
            except Exception as err:  # subclassed models may not clone
                raise ValueError(
                    "model could not be cloned onto the towers' devices: pass a zero-argument "
                    f"factory that builds it instead ({err})"
                ) from err
            source: keras.Model = first or model
        elif callable(model):
            made = model()
            if not isinstance(made, keras.Model):
                raise TypeError(f"model factory must return a keras.Model, got {type(made)}")
            if not made.built:
                raise ValueError("the model factory must return a built model (use keras.Input)")
            source = first if first is not None else made
        else:
            raise TypeError(f"model must be a keras.Model or a factory, got {type(model)}")
        _copy_variables(source, made)
    return made


def _copy_variables(source: keras.Model, target: keras.Model) -> None:
    if source is target:
        return
    if len(source.variables) != len(target.variables):
        raise ValueError("model copies differ in their variables: the factory is not deterministic")
    for s, t in zip(source.variables, target.variables):
        t.assign(np.asarray(s.numpy()))


def _new_optimizer(
    optimizer: OptimizerLike, model: keras.Model, device: str, first: bool
) -> keras.optimizers.Optimizer:
    with tf.device(device):
        if isinstance(optimizer, keras.optimizers.Optimizer):
            if first and not optimizer.built:
                made = optimizer
            else:
                made = type(optimizer).from_config(optimizer.get_config())
        elif callable(optimizer):
            made = optimizer()
            if not isinstance(made, keras.optimizers.Optimizer):
                raise TypeError(
                    f"optimizer factory must return a keras optimizer, got {type(made)}"
                )
        else:
            raise TypeError(f"optimizer must be a Keras optimizer or a factory, got {optimizer!r}")
        made.build(model.trainable_variables)
    return made


def make_replicas(model: ModelLike, optimizer: OptimizerLike, devices: list[str]) -> list[Replica]:
    """Create one replica per device in ``devices``, all starting from the same values.

    Raises:
        ValueError: the model is unbuilt, cannot be cloned, or has no trainable variables.
        TypeError: model or optimizer is of the wrong kind.
    """
    replicas: list[Replica] = []
    first: keras.Model | None = None
    for device in devices:
        made = _new_model(model, device, first)
        if first is None:
            if not made.trainable_variables:
                raise ValueError("model has no trainable variables: there is nothing to train")
            first = made
        opt = _new_optimizer(optimizer, made, device, first=not replicas)
        replicas.append(Replica(device, made, opt))
    return replicas


def variable_values(variables: list[Any]) -> list[np.ndarray]:
    """NumPy copies of a list of Keras variables."""
    return [np.asarray(v.numpy()) for v in variables]
