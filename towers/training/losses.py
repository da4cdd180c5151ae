"""A loss per model output, as Keras's ``compile(loss=[...] | {...}, loss_weights=...)``.

::

    y_pred = model(x)      [out_a, out_b]  (a list, a tuple or a dict)
    y_true                 [y_a,   y_b]    (by position, or a dict by output name)
    losses, weights        [L_a,   L_b], [w_a, w_b]  (or dicts by name; one loss: every output)

    per example i:   w_a · L_a(y_a, out_a)_i  +  w_b · L_b(y_b, out_b)_i

which the step divides, as any per-example loss, by the global batch. Every output's loss
must ask for the same Keras reduction; an output whose loss is None trains no term.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from towers.guard.arguments import naming
from towers.tower import extra_axes, per_example_loss
from towers.training.keras_loss import loss_reduction, resolve_loss

__all__ = ["OutputLosses", "bind_loss", "is_structured", "reduction_of", "step_loss"]


def is_structured(loss: Any) -> bool:
    """``loss`` is a list, tuple or dict of losses (one per output)."""
    return isinstance(loss, list | tuple | Mapping)


def reduction_of(loss: Any) -> str:
    """The Keras reduction ``loss`` asks for (for a loss per output, the one they share; a
    ``ValueError`` when they disagree or it is unsupported)."""
    if isinstance(loss, OutputLosses):
        return loss.reduction
    return OutputLosses(loss).reduction if is_structured(loss) else loss_reduction(loss)


class OutputLosses:
    """``(y_true, y_pred) -> per-example losses`` summed over a multi-output model's outputs.

    Args:
        losses: one loss (every output), a list (model output order) or a dict by output
            name (an output left out or None trains no term).
        weights: None (all 1), a list (per output) or a dict by output name.

    ``ValueError``: losses asking for different reductions, or (at :meth:`bind`) losses or
    weights that do not match the model's outputs.
    """

    def __init__(self, losses: Any, weights: Any = None) -> None:
        self.losses, self.weights = losses, weights
        self.names: list[str] | None = None
        self._fns: list[tuple[Any, float]] = []
        given = losses.values() if isinstance(losses, Mapping) else (
            losses if isinstance(losses, list | tuple) else [losses])  # fmt: skip
        reductions = {loss_reduction(loss) for loss in given if loss is not None}
        if len(reductions) > 1:
            raise ValueError(f"loss: every output's loss must ask for the same reduction, "
                             f"got {sorted(reductions)}")  # fmt: skip
        self.reduction = reductions.pop() if reductions else "sum_over_batch_size"

    def bind(self, model: keras.Model) -> OutputLosses:
        """Match the losses and weights to ``model``'s outputs (by position or name)."""
        names = _output_names(model)
        self.names = names
        losses = self._aligned("loss", self.losses, names, broadcast=True)
        weights = self._aligned("loss_weights", self.weights, names, broadcast=False)
        self._fns = []
        for loss, weight in zip(losses, weights):
            if loss is None:
                self._fns.append((None, 0.0))
                continue
            self._fns.append((resolve_loss(loss), 1.0 if weight is None else float(weight)))
        if all(fn is None for fn, _ in self._fns):
            raise ValueError(f"loss: no output of the model ({', '.join(names)}) has a loss")
        return self

    @staticmethod
    def _aligned(what: str, given: Any, names: list[str], *, broadcast: bool) -> list[Any]:
        if given is None:
            return [None] * len(names)
        if isinstance(given, Mapping):
            unknown = sorted(set(given) - set(names))
            if unknown:
                raise ValueError(f"{what}: {unknown} are not outputs of the model; its outputs "
                                 f"are {names}")  # fmt: skip
            return [given.get(name) for name in names]
        if isinstance(given, list | tuple):
            if len(given) != len(names):
                raise ValueError(f"{what}: {len(given)} entries for a model with "
                                 f"{len(names)} outputs ({', '.join(names)})")  # fmt: skip
            return list(given)
        if broadcast:
            return [given] * len(names)
        raise TypeError(f"{what} must be a list or a dict by output name, got {given!r}")

    def _by_output(self, what: str, values: Any) -> list[Any]:
        assert self.names is not None, "OutputLosses.bind(model) first"
        if isinstance(values, Mapping):
            missing = [n for n in self.names if n not in values]
            if missing:
                raise ValueError(f"{what}: no entry for output(s) {missing}")
            return [values[name] for name in self.names]
        flat = list(values) if isinstance(values, list | tuple) else [values]
        if len(flat) != len(self.names):
            raise ValueError(f"{what}: {len(flat)} parts for a model with {len(self.names)} "
                             f"outputs ({', '.join(self.names)})")  # fmt: skip
        return flat

    def __call__(self, y_true: Any, y_pred: Any) -> tf.Tensor:
        trues, preds = self._by_output("y", y_true), self._by_output("y_pred", y_pred)
        total = None
        for (fn, weight), t, p in zip(self._fns, trues, preds):
            if fn is None:
                continue
            values = per_example_loss(fn, t, p, extra_axes=extra_axes(self.reduction))
            term = values if weight == 1.0 else values * tf.cast(weight, values.dtype)
            total = term if total is None else total + term
        assert total is not None
        return total


def _output_names(model: keras.Model) -> list[str]:
    """The model's output names, else ``output_0``, ``output_1``… (one when it cannot tell)."""
    names = getattr(model, "output_names", None)
    if names:
        return list(names)
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        outputs = None
    return [f"output_{i}" for i in range(len(outputs))] if outputs else ["output_0"]


def step_loss(loss: Any) -> Any:
    """The step's loss before the model exists: one per output, or one resolved callable."""
    if isinstance(loss, OutputLosses):
        return loss
    return OutputLosses(loss) if is_structured(loss) else resolve_loss(loss)


def bind_loss(resolved: Any, loss: Any, model: keras.Model) -> Any:
    """``resolved`` bound to ``model``'s outputs (one ``loss`` for each, when a model with
    several outputs was given one); a ``ValueError`` naming ``loss`` when they do not match."""
    if not isinstance(resolved, OutputLosses) and len(
            getattr(model, "output_names", None) or []) > 1:  # fmt: skip
        resolved = OutputLosses(loss)
    if isinstance(resolved, OutputLosses):
        per_output = resolved
        naming("loss", lambda: per_output.bind(model))
    return resolved
