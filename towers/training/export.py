"""Export the trained model for use without towers: a ``.keras`` file and a SavedModel.

::

    trainer.model ──model.save──▶ <path>/model.keras     Keras: load_model, keep training
                  └─model.export─▶ <path>/saved_model/    TF Serving, TFLite (endpoint "serve")

Both hold one copy of the weights (the replicas are identical). The ``.keras`` file
reloads to outputs bitwise equal to ``trainer.model``'s; the SavedModel is a traced graph
that Grappler fuses when loaded (MatMul + BiasAdd, …), so expect agreement to a few ULPs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from towers.training.protocol import Trainer

__all__ = ["Exported", "export"]


class Exported(NamedTuple):
    """Where :func:`export` wrote the model."""

    keras: str
    saved_model: str


def export(trainer: Trainer, path: str) -> Exported:
    """Save ``trainer.model`` as ``<path>/model.keras`` and a SavedModel in ``<path>/saved_model``.

    Raises:
        ValueError: ``path`` exists and is not a directory.

    Example:
        >>> out = export(trainer, "/tmp/digits")                      # doctest: +SKIP
        >>> keras.models.load_model(out.keras).predict(x)            # doctest: +SKIP
        >>> tf.saved_model.load(out.saved_model).serve(x)            # doctest: +SKIP
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"path must be a directory, but {path!r} is a file")
    os.makedirs(path, exist_ok=True)
    out = Exported(os.path.join(path, "model.keras"), os.path.join(path, "saved_model"))
    trainer.model.save(out.keras)
    trainer.model.export(out.saved_model, verbose=False)
    return out
