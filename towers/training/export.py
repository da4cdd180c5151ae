"""Export the trained model for use without towers; ``TowerModel``'s weights files in the
plain network's layout (:class:`AsNetwork`).

::

    trainer.model ──model.save──▶ <path>/model.keras     Keras: load_model, keep training
                  └─model.export─▶ <path>/saved_model/    TF Serving, TFLite (endpoint "serve")

The ``.keras`` file reloads bitwise; the SavedModel (fused by Grappler) to a few ULPs.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import keras
from keras.src.saving.keras_saveable import KerasSaveable

from towers.devices import canonical_device
from towers.guard.given import check_devices
from towers.training.checkpoint import check_path
from towers.training.protocol import Trainer

__all__ = ["AsNetwork", "Exported", "export", "tower_model_arguments", "tower_model_config"]


class Exported(NamedTuple):
    keras: str
    saved_model: str


def export(trainer: Trainer, path: str) -> Exported:
    """Save ``trainer.model`` as ``<path>/model.keras`` and a SavedModel in ``<path>/saved_model``
    (``ValueError``: ``path`` is a file).

    Example:
        >>> out = export(trainer, "/tmp/digits")                      # doctest: +SKIP
        >>> keras.models.load_model(out.keras).predict(x)            # doctest: +SKIP
        >>> tf.saved_model.load(out.saved_model).serve(x)            # doctest: +SKIP
    """
    path = check_path(path, "path", "a directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"path must be a directory, but {path!r} is a file")
    os.makedirs(path, exist_ok=True)
    out = Exported(os.path.join(path, "model.keras"), os.path.join(path, "saved_model"))
    trainer.model.save(out.keras)
    trainer.model.export(out.saved_model, verbose=False)
    return out


class AsNetwork(KerasSaveable):  # type: ignore[misc]
    """A ``TowerModel`` as Keras's weights files walk it: its network's own layout (files the
    plain model reads and writes) plus the towers' optimizers."""

    _TOWERS = ("optimizer", "shard_optimizers")

    def __init__(self, model: Any) -> None:
        self._model = model

    def _obj_type(self) -> str:
        return str(self._model.network._obj_type())

    def __getattr__(self, name: str) -> Any:
        if name == "_model":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        owner = self._model if name in self._TOWERS else self._model.network
        return getattr(owner, name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._model.network)) | set(self._TOWERS))


def tower_model_config(tm: Any) -> dict[str, Any]:
    """A ``TowerModel``'s config: its network's, its options, its devices as a count
    (``ValueError``: ``all_reduce`` is a callable, not a name or ``module:NAME``)."""
    algorithm = tm.options.all_reduce
    if algorithm is not None and not isinstance(algorithm, str):
        raise ValueError(f"all_reduce={algorithm!r} cannot be saved in a .keras file (its config "
                         "needs a registry name or module:NAME); use tm.save_weights "
                         "(ModelCheckpoint(save_weights_only=True)) or towers.training."
                         "checkpoint, or pass the reducer as module:NAME")
    options = tm.options.arguments()
    pd = options["parameter_device"] and canonical_device(options["parameter_device"])
    options["parameter_device"] = tm.devices.index(pd) if pd in tm.devices else None
    return {
        "name": tm.name, "model": keras.saving.serialize_keras_object(tm.network),
        "num_devices": len(tm.devices), **options}  # fmt: skip


def tower_model_arguments(config: dict[str, Any], custom_objects: Any = None) -> dict[str, Any]:
    """``TowerModel``'s arguments from :func:`tower_model_config` (``num_devices`` local ones)."""
    config = dict(config)
    network = keras.saving.deserialize_keras_object(config.pop("model"),
                                                    custom_objects=custom_objects)
    devices = check_devices(None)[: config.pop("num_devices")]
    pd = config.pop("parameter_device", None)
    return {"model": network, "devices": devices,
            "parameter_device": None if pd is None or pd >= len(devices) else devices[pd],
            **config}  # fmt: skip
