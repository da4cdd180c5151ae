"""The step protocol: anything ``compare``, ``bisect`` and ``assert_steps_match`` can drive.

A *step* has three methods::

    step.train_step(x, y, sample_weight=None)   one synchronous update on a global batch
    step.get_weights() -> [np.ndarray]          in model.weights order
    step.set_weights(ws)                        every replica's copy

``TowerTrainer`` and the ``reference`` trainers are steps; a user's step function becomes
one with :func:`as_step`. Optional attributes sharpen a comparison: ``model`` (names, the
gradients that size a bound), ``optimizer`` (which bound), ``loss_fn``, ``devices`` or
``strategy`` (the tower count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf

__all__ = ["AdaptedStep", "Step", "as_step", "check_step", "is_step", "step_towers"]

_METHODS = ("train_step", "get_weights", "set_weights")


@runtime_checkable
class Step(Protocol):
    """One synchronous data-parallel training step with readable, settable weights."""

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """Run one update on the global batch ``(x, y)``; returns the loss (any form)."""

    def get_weights(self) -> list[np.ndarray]:
        """The weights as NumPy arrays, in ``model.weights`` order."""

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Set every replica's copy of every weight."""


def is_step(value: Any) -> bool:
    """``value`` has the protocol's three methods."""
    return all(callable(getattr(value, m, None)) for m in _METHODS)


def check_step(name: str, value: Any) -> Step:
    """``value`` when it is a step.

    Raises:
        TypeError: naming ``name`` and the missing methods.
    """
    missing = [m for m in _METHODS if not callable(getattr(value, m, None))]
    if missing:
        raise TypeError(f"{name} must be a step (train_step(x, y, sample_weight=None), "
                        f"get_weights(), set_weights(ws)); {type(value).__name__} lacks "
                        f"{', '.join(missing)}: wrap a step function with "
                        "towers.testing.as_step(fn, model)")  # fmt: skip
    return value


def step_towers(step: Any) -> int | None:
    """A step's tower count: its ``devices``, or its strategy's replicas; None if unknown."""
    devices = getattr(step, "devices", None)
    if devices:
        return len(devices)
    strategy = getattr(step, "strategy", None)
    return None if strategy is None else int(strategy.num_replicas_in_sync)


class AdaptedStep:
    """A user's step function as a :class:`Step` (made by :func:`as_step`)."""

    def __init__(self, fn: Callable[[Any], Any], model: Any, *, strategy: Any = None,
                 optimizer: Any = None, loss: Any = None) -> None:  # fmt: skip
        self.fn, self.model, self.strategy, self.loss_fn = fn, model, strategy, loss
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """Call the step function on the batch (distributed by the strategy, if any)."""
        batch = (x, y) if sample_weight is None else (x, y, sample_weight)
        if self.strategy is None:
            return self.fn(batch)
        data = tf.data.Dataset.from_tensors(tf.nest.map_structure(tf.convert_to_tensor, batch))
        return self.fn(next(iter(self.strategy.experimental_distribute_dataset(data))))

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights (replica 0's copy under a strategy)."""
        return [np.array(v.numpy()) for v in self.model.weights]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign the model's weights (every replica's copy under a strategy)."""
        arrays = [np.asarray(w) for w in weights]
        if self.strategy is None:
            self.model.set_weights(arrays)
            return
        with self.strategy.scope():
            self.model.set_weights(arrays)


def as_step(fn: Callable[[Any], Any], model: Any, *, strategy: Any = None,
            optimizer: Any = None, loss: Any = None) -> AdaptedStep:  # fmt: skip
    """A user's step function as a :class:`Step`: the one-line adapter.

    Args:
        fn: the step function, called with one batch ``(x, y)`` or ``(x, y, sample_weight)``
            (the tutorial's ``distributed_train_step(inputs)``).
        model: the ``keras.Model`` it trains (its weights are the step's weights).
        strategy: the strategy ``fn`` runs under, if any: it distributes the batch, and
            weights are set inside its scope.
        optimizer, loss: what ``fn`` applies and minimizes (default ``model.optimizer``):
            they pick and size the bound.

    Raises:
        TypeError: ``fn`` is not callable, or ``model`` has no ``weights``.

    Example:
        >>> step = as_step(distributed_train_step, model, strategy=strategy,
        ...                optimizer=optimizer)                       # doctest: +SKIP
    """
    if not callable(fn):
        raise TypeError(f"fn must be a step function (called with one batch), got {fn!r}")
    if not hasattr(model, "weights"):
        raise TypeError(f"model must be the keras.Model the step trains, got {model!r}")
    return AdaptedStep(fn, model, strategy=strategy, optimizer=optimizer, loss=loss)
