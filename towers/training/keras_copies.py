"""A Keras model and optimizer copied onto a device, whole: what a replica is made of.

A copy takes every variable (seed-generator state included) and the layer state Keras keeps
outside variables, so every replica starts bitwise equal.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any, TypeAlias

import keras
import numpy as np
import tensorflow as tf

from towers.devices import canonical_device

__all__ = ["ModelLike", "OptimizerLike", "copy_state", "new_model", "new_optimizer"]

ModelLike: TypeAlias = "keras.Model | Callable[[], keras.Model]"
OptimizerLike: TypeAlias = "keras.optimizers.Optimizer | Callable[[], keras.optimizers.Optimizer]"


def new_model(model: ModelLike, device: str, first: keras.Model | None) -> keras.Model:
    """``model`` on ``device`` with ``first``'s state (None: its own): ``model`` itself
    when it is replica 0's and lives there, else a clone or the factory's new model."""
    with tf.device(device):
        if isinstance(model, keras.Model):
            if first is None and model.built and all(
                    canonical_device(v.value.device) == device for v in model.variables):
                return model
            if not model.built:
                raise ValueError("model is not built: give it an Input (keras.Input) or call it "
                                 "once, or pass a zero-argument factory that returns a built model")
            try:
                made = keras.models.clone_model(model)
            except Exception as err:  # subclassed models may not clone
                raise ValueError("model could not be cloned onto the towers' devices: pass a "
                                 f"zero-argument factory that builds it instead ({err})") from err
        elif callable(model):
            made = model()
            if not isinstance(made, keras.Model):
                raise TypeError(f"model factory must return a keras.Model, got {type(made)}")
            if not made.built:
                raise ValueError("the model factory must return a built model (use keras.Input)")
        else:
            raise TypeError(f"model must be a keras.Model or a factory, got {type(model)}")
        own = model if isinstance(model, keras.Model) else made
        copy_state(first if first is not None else own, made)
    return made


def copy_state(source: keras.Model, target: keras.Model) -> None:
    """Give ``target`` (a copy of ``source``'s architecture) ``source``'s whole state: every
    variable, then each layer's own variables and assets (a lookup table's vocabulary)."""
    if source is target:
        return
    if len(source.variables) != len(target.variables):
        raise ValueError("model copies differ in their variables: the factory is not deterministic")
    for s, t in zip(source.variables, target.variables):
        t.assign(np.asarray(s.numpy()))
    layers = [list(m._flatten_layers(include_self=False, recursive=True)) for m in (source, target)]
    for mine, theirs in zip(*layers):
        store: dict[str, Any] = {}
        mine.save_own_variables(store)
        theirs.load_own_variables(store)
        if hasattr(mine, "save_assets") and hasattr(theirs, "load_assets"):
            with tempfile.TemporaryDirectory() as folder:
                mine.save_assets(folder)
                theirs.load_assets(folder)


def new_optimizer(optimizer: OptimizerLike, variables: list[Any], device: str,
                  first: bool) -> keras.optimizers.Optimizer:
    """An optimizer on ``device`` built for ``variables``: ``optimizer`` itself when it is
    replica 0's (``first``) and unbuilt, else a copy from its config or the factory's."""
    with tf.device(device):
        if isinstance(optimizer, keras.optimizers.Optimizer):
            made = optimizer if first and not optimizer.built \
                else type(optimizer).from_config(optimizer.get_config())
        elif callable(optimizer):
            made = optimizer()
            if not isinstance(made, keras.optimizers.Optimizer):
                raise TypeError(
                    f"optimizer factory must return a keras optimizer, got {type(made)}")
        else:
            raise TypeError(f"optimizer must be a Keras optimizer or a factory, got {optimizer!r}")
        made.build(variables)
    return made
