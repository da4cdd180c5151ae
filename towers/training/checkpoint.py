"""Save a trainer's whole state and resume it, bitwise, in another process.

What a step's result depends on, and so what a checkpoint holds::

    checkpoint
    ├── replica_0/model/0 … k        every variable of every replica's model: weights,
    │   replica_0/optimizer/0 … m    BatchNorm statistics, dropout seed state; the optimizer's
    ├── replica_1/…                  iteration count, learning rate and slots (Adam's m, v)
    ├── step                         the optimizer's iteration counter (one per train_step)
    └── all_reduce                   the algorithm, when it is a tf.Module (compression
                                     residuals, error feedback: state that shapes the next step)

The variables are listed explicitly, replica by replica, in ``model.variables`` and
``optimizer.variables`` order. Tracking the Keras objects instead
(``tf.train.Checkpoint(model=model)``) is not enough: measured on Keras 3.15, such a
checkpoint held the optimizer's slots but neither the model's weights as such nor the
dropout ``seed_generator_state``, so a resumed run would draw different dropout masks.

A checkpoint restores into a trainer built the same way (same model, optimizer,
placement and number of replicas); anything else is a ValueError.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from towers.training.protocol import Trainer

__all__ = ["checkpoint", "restore", "save"]

_RESERVED = ("step", "all_reduce")
_STEP_KEY = "step/.ATTRIBUTES/VARIABLE_VALUE"


def _tf_variables(variables: list[Any]) -> list[tf.Variable]:
    """The ``tf.Variable`` behind each Keras variable (``.value`` on the TF backend)."""
    return [getattr(v, "value", v) for v in variables]


def checkpoint(trainer: Trainer, **extra: Any) -> tf.train.Checkpoint:
    """A ``tf.train.Checkpoint`` of everything that determines the trainer's next step.

    Args:
        trainer: the :class:`~towers.TowerTrainer`.
        **extra: more trackable objects to save alongside (e.g. an epoch counter
            ``tf.Variable`` or a ``tf.data`` iterator).

    Returns:
        A checkpoint with ``replica_<i>`` (``model`` and ``optimizer`` variable lists),
        ``step`` and, if the all-reduce algorithm is a ``tf.Module``, ``all_reduce``.

    Raises:
        ValueError: an ``extra`` name collides with one of those.

    Example:
        >>> ckpt = checkpoint(trainer, epoch=epoch_var)              # doctest: +SKIP
        >>> ckpt.write("/tmp/run/ckpt")                              # doctest: +SKIP
    """
    clash = [k for k in extra if k in _RESERVED or k.startswith("replica_")]
    if clash:
        raise ValueError(f"extra: the names {clash} are reserved for the trainer's own state")
    parts: dict[str, Any] = {
        f"replica_{i}": tf.train.Checkpoint(
            model=_tf_variables(r.model.variables),
            optimizer=_tf_variables(r.optimizer.variables),
        )
        for i, r in enumerate(trainer.replicas)
    }
    parts["step"] = _tf_variables([trainer.optimizer.iterations])[0]
    if isinstance(trainer.algorithm, tf.Module):
        parts["all_reduce"] = trainer.algorithm
    return tf.train.Checkpoint(**parts, **extra)


def save(trainer: Trainer, path: str) -> str:
    """Write the trainer's state to ``path`` (a file prefix) and return the prefix.

    Example:
        >>> prefix = save(trainer, "/tmp/run/ckpt")                  # doctest: +SKIP
    """
    written: str = checkpoint(trainer).write(str(path))
    return written


def _expected_shapes(trainer: Trainer) -> dict[str, list[int]]:
    """The checkpoint keys of the replicas' variables, with their shapes.

    A variable tracked twice is saved once, under its shortest path: the first
    replica's iteration counter is saved as ``step``.
    """
    step = _tf_variables([trainer.optimizer.iterations])[0]
    shapes = {_STEP_KEY: [int(d) for d in step.shape]}
    for i, replica in enumerate(trainer.replicas):
        parts = (("model", replica.model.variables), ("optimizer", replica.optimizer.variables))
        for part, variables in parts:
            for j, v in enumerate(_tf_variables(variables)):
                if v is not step:
                    key = f"replica_{i}/{part}/{j}/.ATTRIBUTES/VARIABLE_VALUE"
                    shapes[key] = [int(d) for d in v.shape]
    return shapes


def _check_matches(trainer: Trainer, path: str) -> None:
    """Compare keys and shapes before anything is assigned (a failed read would leave the
    trainer half restored)."""
    saved = {
        k: list(s)
        for k, s in tf.train.list_variables(path)
        if k.startswith("replica_") or k == _STEP_KEY
    }
    expected = _expected_shapes(trainer)
    problems = [f"missing {k}" for k in expected if k not in saved]
    problems += [f"unexpected {k}" for k in saved if k not in expected]
    problems += [
        f"{k}: shape {saved[k]} in the checkpoint, {shape} here"
        for k, shape in expected.items()
        if k in saved and saved[k] != shape
    ]
    if problems:
        raise ValueError(
            f"the checkpoint at {path!r} does not match this trainer (build it with the same "
            "model, optimizer, variables= placement and devices): " + "; ".join(problems[:5])
        )


def restore(trainer: Trainer, path: str) -> None:
    """Load a state written by :func:`save` into a trainer built the same way.

    Every value in the checkpoint must find its variable and every variable its value;
    keys and shapes are checked before anything is assigned.

    Raises:
        ValueError: the checkpoint does not match this trainer (other model, optimizer,
            placement or number of replicas).
        tf.errors.NotFoundError: nothing is saved at ``path``.

    Example:
        >>> restore(trainer, "/tmp/run/ckpt")                        # doctest: +SKIP
    """
    _check_matches(trainer, str(path))
    status = checkpoint(trainer).read(str(path))
    try:
        status.assert_consumed()
    except AssertionError as err:
        raise ValueError(
            f"the checkpoint at {path!r} does not match this trainer: build it with the same "
            f"model, optimizer, variables= placement and devices ({err})"
        ) from err
