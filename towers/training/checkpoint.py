"""Save a trainer's whole state and resume it, bitwise, in another process.

::

    checkpoint
    ├── replica_0/model/0 … k        every variable of every replica's model (weights,
    │   replica_0/optimizer/0 … m    BatchNorm statistics, seed state) and optimizer
    ├── replica_1/…                  (iterations, learning rate, slots; sharded: its shard)
    ├── step                         the optimizer's iteration counter
    ├── all_reduce                   the algorithm, when it is a tf.Module (error feedback)
    └── record                       what all of it is (:mod:`towers.training.signature`)

Variables are listed, not tracked through Keras objects (which misses the dropout
``seed_generator_state``).
"""

from __future__ import annotations

import copy
import gc
import warnings
from typing import Any

import tensorflow as tf

from towers.guard.errors import CheckpointError
from towers.training.atomic import check_path, checkpoints, latest, verify
from towers.training.protocol import Trainer
from towers.training.signature import MISMATCH, READ_ERRORS, Record, check

__all__ = ["checkpoint", "checkpoints", "latest", "load", "restore", "save", "verify"]


def _tf_variables(variables: list[Any]) -> list[tf.Variable]:
    """The ``tf.Variable`` behind each Keras variable (``.value`` on the TF backend)."""
    return [getattr(v, "value", v) for v in variables]


def checkpoint(trainer: Trainer, **extra: Any) -> tf.train.Checkpoint:
    """A ``tf.train.Checkpoint`` of everything that determines the trainer's next step, and
    ``extra`` trackables (not named as its own parts)."""
    _check_trainer(trainer)
    clash = [k for k in extra if k in ("step", "all_reduce", "record") or k.startswith("replica_")]
    if clash:
        raise ValueError(f"extra: the names {clash} are reserved for the trainer's own state")
    parts: dict[str, Any] = {
        f"replica_{i}": tf.train.Checkpoint(model=_tf_variables(r.model.variables),
                                            optimizer=_tf_variables(r.optimizer.variables))
        for i, r in enumerate(trainer.replicas)}  # fmt: skip
    parts["step"] = _tf_variables([trainer.optimizer.iterations])[0]
    if isinstance(trainer.algorithm, tf.Module):
        parts["all_reduce"] = trainer.algorithm
    parts["record"] = Record(trainer)
    return tf.train.Checkpoint(**parts, **extra)


def save(trainer: Trainer, path: str) -> str:
    """Write the trainer's state to ``path`` (a file prefix) and return the prefix."""
    return str(checkpoint(trainer).write(check_path(path, "path", "a file prefix")))


def load(trainer: Trainer, prefix: str) -> dict[str, Any]:
    """Restore a checkpoint of :func:`towers.training.atomic.write`, verified; its position."""
    position = verify(check_path(prefix, "prefix", "a file prefix"))
    restore(trainer, prefix)
    return position


def restore(trainer: Trainer, path: str) -> None:
    """Load a state written by :func:`save` into a trainer built the same way, all or
    nothing; the learning rate is the checkpoint's (a ``UserWarning`` if it replaces another).

    Raises:
        TypeError: ``trainer`` is not a trainer, or ``path`` not a path.
        CheckpointError: nothing at ``path``, damaged, or not this trainer's (named).
    """
    _check_trainer(trainer)
    path = check_path(path, "path", "a file prefix")
    try:
        reader = tf.train.load_checkpoint(path)
        saved = list(reader.get_variable_to_shape_map())
    except READ_ERRORS as err:
        raise CheckpointError(path, f"cannot be read ({type(err).__name__}: {err})") from err
    note = check(reader, path, trainer)
    _check_algorithm_state(trainer, path, saved)
    for key in saved:
        try:
            reader.get_tensor(key)
        except READ_ERRORS as err:
            raise CheckpointError(path, f"{key} cannot be read ({type(err).__name__}: {err})"
                                  ) from err  # fmt: skip
    backup = [(v, tf.identity(v)) for v in _written(trainer)]
    try:
        checkpoint(trainer).read(path).assert_consumed()
    except (*READ_ERRORS, AssertionError) as err:
        for variable, value in backup:
            variable.assign(value)
        raise CheckpointError(path, MISMATCH + str(err)) from err
    if note:
        warnings.warn(f"checkpoint {path!r}: {note}", UserWarning, stacklevel=2)


def _check_trainer(trainer: Any) -> None:
    if not all(hasattr(trainer, a) for a in ("replicas", "optimizer", "algorithm")):
        raise TypeError(f"trainer must be a towers.TowerTrainer; got {type(trainer).__name__}")


def _check_algorithm_state(trainer: Trainer, path: str, saved: list[str]) -> None:
    """Restore the all-reduce's state into a copy first, before the trainer's is written."""
    in_file = [k for k in saved if k.startswith("all_reduce/")]
    if not isinstance(trainer.algorithm, tf.Module):
        if in_file:
            raise CheckpointError(path, MISMATCH + "it holds all-reduce state, this one none")
        return
    shadow = copy.deepcopy(trainer.algorithm)
    problem = ""
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")  # a failed partial read warns about every value it left
    try:
        status = tf.train.Checkpoint(all_reduce=shadow).read(path).expect_partial()
        status.assert_existing_objects_matched()
    except (*READ_ERRORS, AssertionError) as err:
        problem = f"the all-reduce's state: {err}"
    finally:
        gc.collect()  # the failed read's leftovers warn when collected: do it here, quietly
        logger.setLevel(level)
    if not problem and len(in_file) != len(shadow.variables):
        problem = (f"{len(in_file)} all-reduce state values in the checkpoint, "
                   f"{len(shadow.variables)} here")  # fmt: skip
    if problem:
        raise CheckpointError(path, MISMATCH + problem)


def _written(trainer: Trainer) -> list[tf.Variable]:
    """Every variable a restore writes."""
    found: list[Any] = [trainer.optimizer.iterations]
    for r in trainer.replicas:
        found += [*r.model.variables, *r.optimizer.variables]
    state = trainer.algorithm.variables if isinstance(trainer.algorithm, tf.Module) else ()
    return _tf_variables(found) + list(state)
