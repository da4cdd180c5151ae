"""Save a trainer's whole state and resume it, bitwise, in another process.

What a step's result depends on, and so what a checkpoint holds::

    checkpoint
    ├── replica_0/model/0 … k        every variable of every replica's model: weights,
    │   replica_0/optimizer/0 … m    BatchNorm statistics, dropout seed state; the optimizer's
    ├── replica_1/…                  iteration count, learning rate and slots (Adam's m, v)
    ├── step                         the optimizer's iteration counter (one per train_step)
    ├── all_reduce                   the algorithm, when it is a tf.Module (compression
    │                                residuals, error feedback: state that shapes the next step)
    └── record                       what all of it is (JSON, :mod:`towers.training.signature`):
                                     placement, replicas, optimizer class and hyperparameters,
                                     every variable's path, shape and dtype, the all-reduce

The variables are listed explicitly, replica by replica, in ``model.variables`` and
``optimizer.variables`` order. Tracking the Keras objects instead
(``tf.train.Checkpoint(model=model)``) is not enough: measured on Keras 3.15, such a
checkpoint held the optimizer's slots but neither the model's weights as such nor the
dropout ``seed_generator_state``, so a resumed run would draw different dropout masks.

Under ``variables="sharded"`` replica ``k``'s optimizer holds only tower ``k``'s shard
of the slots, so ``replica_<k>/optimizer`` is that shard; such a checkpoint restores
into the same number of towers only (no re-sharding: another count is refused).

A checkpoint restores into a trainer built the same way (same model, optimizer class
and hyperparameters, placement, number of replicas, all-reduce state), all or nothing:
the record is compared first, and anything else — or a checkpoint without a record, a
missing, truncated or corrupt file — is a :class:`~towers.CheckpointError` naming the
path and what differs, with the trainer unchanged. The learning rate is the one thing
restored that may differ: the checkpoint's is restored, with a ``UserWarning`` when it
replaces another (docs/checkpoints.md).
"""

from __future__ import annotations

import copy
import gc
import os
import warnings
from typing import Any

import tensorflow as tf

from towers.guard.errors import CheckpointError
from towers.training.atomic import checkpoints, latest, verify
from towers.training.protocol import Trainer
from towers.training.signature import Record, check

__all__ = ["checkpoint", "checkpoints", "latest", "load", "restore", "save", "verify"]

_RESERVED = ("step", "all_reduce", "record")
_STEP_KEY = "step/.ATTRIBUTES/VARIABLE_VALUE"
_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_READ_ERRORS = (tf.errors.OpError, ValueError, IndexError, OSError, RuntimeError)
_MISMATCH = "does not match this trainer: "


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
        ``step``, ``record`` (what the trainer is: :func:`towers.training.signature.record`)
        and, if the all-reduce algorithm is a ``tf.Module``, ``all_reduce``.

    Raises:
        ValueError: an ``extra`` name collides with one of those.

    Example:
        >>> ckpt = checkpoint(trainer, epoch=epoch_var)              # doctest: +SKIP
        >>> ckpt.write("/tmp/run/ckpt")                              # doctest: +SKIP
    """
    _check_trainer(trainer)
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
    parts["record"] = Record(trainer)
    return tf.train.Checkpoint(**parts, **extra)


def save(trainer: Trainer, path: str) -> str:
    """Write the trainer's state to ``path`` (a file prefix) and return the prefix.

    Raises:
        TypeError: ``trainer`` is not a trainer, or ``path`` not a str or ``os.PathLike``.

    Example:
        >>> prefix = save(trainer, "/tmp/run/ckpt")                  # doctest: +SKIP
    """
    path = _check_path(path)
    written: str = checkpoint(trainer).write(path)
    return written


def load(trainer: Trainer, prefix: str) -> dict[str, Any]:
    """Restore one checkpoint of a directory (:func:`towers.training.atomic.write`), checked.

    Returns:
        The position saved with it (``ExactResume``'s epoch and batch).

    Raises:
        CheckpointError: naming ``prefix``: its manifest does not match its files
            (truncated, corrupt), or :func:`restore` refuses it. The trainer is unchanged.

    Example:
        >>> load(trainer, latest("/tmp/run"))                        # doctest: +SKIP
    """
    position = verify(_check_path(prefix))
    restore(trainer, prefix)
    return position


def _check_trainer(trainer: Any) -> None:
    if not all(hasattr(trainer, a) for a in ("replicas", "optimizer", "algorithm")):
        raise TypeError(f"trainer must be a towers.TowerTrainer; got {type(trainer).__name__}")


def _check_path(path: Any) -> str:
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise TypeError(f"path must be a file prefix (str or os.PathLike); got {path!r}")
    return str(path)


_Inventory = dict[str, tuple[list[int], tf.DType]]


def _inventory(path: str) -> tuple[Any, _Inventory]:
    """The checkpoint's reader and ``{key: (shape, dtype)}`` of its values.

    Raises:
        CheckpointError: nothing at ``path``, or its index cannot be read (truncated, corrupt).
    """
    try:
        reader = tf.train.load_checkpoint(path)
        shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    except _READ_ERRORS as err:
        raise CheckpointError(path, f"cannot be read ({type(err).__name__}: {err})") from err
    return reader, {k: (list(shapes[k]), dtypes[k]) for k in shapes if k != _GRAPH_KEY}


def _expected(trainer: Trainer) -> _Inventory:
    """The checkpoint keys of the replicas' variables, with their shapes and dtypes.

    A variable tracked twice is saved once, under its shortest path: the first
    replica's iteration counter is saved as ``step``.
    """
    step = _tf_variables([trainer.optimizer.iterations])[0]
    expected = {_STEP_KEY: ([int(d) for d in step.shape], step.dtype)}
    for i, replica in enumerate(trainer.replicas):
        parts = (("model", replica.model.variables), ("optimizer", replica.optimizer.variables))
        for part, variables in parts:
            for j, v in enumerate(_tf_variables(variables)):
                if v is not step:
                    key = f"replica_{i}/{part}/{j}/.ATTRIBUTES/VARIABLE_VALUE"
                    expected[key] = ([int(d) for d in v.shape], v.dtype)
    return expected


def _check_replicas(trainer: Trainer, path: str, saved: _Inventory) -> None:
    """Compare keys, shapes and dtypes of every replica's variables with the file's."""
    saved = {k: v for k, v in saved.items() if k.startswith("replica_") or k == _STEP_KEY}
    expected = _expected(trainer)
    problems = [f"missing {k}" for k in expected if k not in saved]
    problems += [f"unexpected {k}" for k in saved if k not in expected]
    for k, (shape, dtype) in expected.items():
        if k in saved and saved[k] != (shape, dtype):
            got_shape, got_dtype = saved[k]
            problems.append(
                f"{k}: {got_dtype.name}{got_shape} in the checkpoint, {dtype.name}{shape} here"
            )
    if problems:
        raise CheckpointError(path, _MISMATCH + "; ".join(problems[:5]))


def _check_algorithm_state(trainer: Trainer, path: str, saved: _Inventory) -> None:
    """Restore the all-reduce's state (codec, error feedback) into a copy first: a shape,
    dtype or count that differs fails there, before any of the trainer's state is written."""
    in_file = [k for k in saved if k.startswith("all_reduce/")]
    if not isinstance(trainer.algorithm, tf.Module):
        if in_file:
            raise CheckpointError(path, _MISMATCH + "it holds all-reduce state, this one none")
        return
    shadow = copy.deepcopy(trainer.algorithm)
    problem = ""
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")  # a failed partial read warns about every value it left
    try:
        status = tf.train.Checkpoint(all_reduce=shadow).read(path).expect_partial()
        status.assert_existing_objects_matched()
    except (*_READ_ERRORS, AssertionError) as err:
        problem = f"the all-reduce's state: {err}"
    finally:
        gc.collect()  # the failed read's leftovers warn when collected: do it here, quietly
        logger.setLevel(level)
    if problem:
        raise CheckpointError(path, _MISMATCH + problem)
    if len(in_file) != len(shadow.variables):
        raise CheckpointError(
            path, _MISMATCH + f"{len(in_file)} all-reduce state values in the checkpoint, "
            f"{len(shadow.variables)} here",
        )  # fmt: skip


def _read_every_value(reader: Any, path: str, saved: _Inventory) -> None:
    """Read every value once (the bundle's checksums catch truncated or corrupt data)."""
    for key in saved:
        try:
            reader.get_tensor(key)
        except _READ_ERRORS as err:
            raise CheckpointError(
                path, f"{key} cannot be read ({type(err).__name__}: {err})"
            ) from err


def restore(trainer: Trainer, path: str) -> None:
    """Load a state written by :func:`save` into a trainer built the same way: all or nothing.

    Before anything is assigned, the checkpoint's record is compared with this trainer
    (:func:`towers.training.signature.mismatch`), every variable's key, shape and dtype
    with the file's (the all-reduce's state is restored into a copy first) and every
    value is read once. Should the real read still fail, the trainer's previous values
    are put back. A fixed learning rate is restored too; when it replaces another, a
    ``UserWarning`` names both.

    Raises:
        TypeError: ``trainer`` is not a trainer, or ``path`` not a str or ``os.PathLike``.
        CheckpointError: (a ``ValueError``) nothing is saved at ``path``; the files are
            truncated or corrupt; it has no record (written before towers kept one); or
            it does not match this trainer (other placement, number of replicas,
            optimizer class or hyperparameters, model, optimizer variables or all-reduce
            state): the message names the difference. The trainer is unchanged.

    Example:
        >>> restore(trainer, "/tmp/run/ckpt")                        # doctest: +SKIP
    """
    _check_trainer(trainer)
    path = _check_path(path)
    reader, saved = _inventory(path)
    note = check(reader, path, trainer)
    _check_replicas(trainer, path, saved)
    _check_algorithm_state(trainer, path, saved)
    _read_every_value(reader, path, saved)
    ckpt = checkpoint(trainer)
    backup = _snapshot(trainer)
    try:
        ckpt.read(path).assert_consumed()
    except (*_READ_ERRORS, AssertionError) as err:
        _put_back(backup)
        raise CheckpointError(path, _MISMATCH + str(err)) from err
    if note:
        warnings.warn(f"checkpoint {path!r}: {note}", UserWarning, stacklevel=2)


def _snapshot(trainer: Trainer) -> list[tuple[tf.Variable, Any]]:
    """Every variable a restore writes, with its current value."""
    found: list[Any] = [trainer.optimizer.iterations]
    for r in trainer.replicas:
        found += [*r.model.variables, *r.optimizer.variables]
    variables = _tf_variables(found)
    if isinstance(trainer.algorithm, tf.Module):
        variables += list(trainer.algorithm.variables)
    return [(v, tf.identity(v)) for v in variables]


def _put_back(backup: list[tuple[tf.Variable, Any]]) -> None:
    for variable, value in backup:
        variable.assign(value)
