"""Save a trainer's whole state and resume it, bitwise, in another process; numbered
checkpoints in a directory, written atomically, the newest good one found.

What a checkpoint holds::

    checkpoint
    ├── replica_0/model/0 … k        every variable of every replica's model (weights,
    │   replica_0/optimizer/0 … m    BatchNorm statistics, seed state) and optimizer
    ├── replica_1/…                  (iterations, learning rate, slots; sharded: its shard)
    ├── step                         the optimizer's iteration counter
    ├── all_reduce                   the algorithm, when it is a tf.Module (error feedback)
    └── record                       what all of it is (:mod:`towers.training.signature`)

Variables are listed, not tracked through Keras objects (which misses the dropout
``seed_generator_state``).

What :func:`write` does, and what a crash at each point leaves behind::

    directory/
    │ 1. write  .tmp-ckpt-00000012-<pid>/state.index, state.data-*   crash: a .tmp-* dir,
    │           .tmp-ckpt-00000012-<pid>/position.json                      never read
    │ 2. write  .tmp-ckpt-00000012-<pid>/MANIFEST.json  (size, sha256 of every file)
    │    fsync every file, then the temporary directory
    │ 3. rename .tmp-ckpt-00000012-<pid>  ─▶  ckpt-00000012          atomic (one syscall)
    │    fsync the directory                                       crash: ckpt-12 complete
    │ 4. write  .latest.tmp, fsync, rename ─▶ latest  ("ckpt-00000012")
    │ 5. delete an older save of the same number, then the oldest beyond ``keep``
    ▼
    latest(directory): ckpt-* newest first; the first whose MANIFEST matches every
    file (size and sha256) wins; a damaged one is skipped with a warning.

``latest`` trusts the manifests, not the pointer (for people and tools). A number saved
again is ``ckpt-00000012.1``; the old one goes only at step 5.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import tensorflow as tf

from towers.guard.arguments import non_negative_int, optional, positive_int
from towers.guard.errors import CheckpointError
from towers.training.protocol import Trainer
from towers.training.signature import MISMATCH, READ_ERRORS, Record, check

__all__ = ["check_path", "checkpoint", "checkpoints", "latest", "load", "restore", "save",
           "verify", "write"]  # fmt: skip

PREFIX, MANIFEST, POSITION, POINTER = "state", "MANIFEST.json", "position.json", "latest"
_NAME = re.compile(r"^ckpt-(\d+)(?:\.(\d+))?$")


def _tf_variables(variables: list[Any]) -> list[tf.Variable]:
    """The ``tf.Variable`` behind each Keras variable (``.value`` on the TF backend)."""
    return [getattr(v, "value", v) for v in variables]


def checkpoint(trainer: Trainer) -> tf.train.Checkpoint:
    """A ``tf.train.Checkpoint`` of everything that determines the trainer's next step."""
    _check_trainer(trainer)
    parts: dict[str, Any] = {
        f"replica_{i}": tf.train.Checkpoint(model=_tf_variables(r.model.variables),
                                            optimizer=_tf_variables(r.optimizer.variables))
        for i, r in enumerate(trainer.replicas)}  # fmt: skip
    parts["step"] = _tf_variables([trainer.optimizer.iterations])[0]
    if isinstance(trainer.algorithm, tf.Module):
        parts["all_reduce"] = trainer.algorithm
    parts["record"] = Record(trainer)
    return tf.train.Checkpoint(**parts)


def save(trainer: Trainer, path: str) -> str:
    """Write the trainer's state to ``path`` (a file prefix) and return the prefix."""
    return str(checkpoint(trainer).write(check_path(path, "path", "a file prefix")))


def load(trainer: Trainer, prefix: str) -> dict[str, Any]:
    """Restore a checkpoint of :func:`write`, verified; return its position."""
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
            raise CheckpointError(
                path, f"{key} cannot be read ({type(err).__name__}: {err})") from err
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
    shadow, problem, logger = copy.deepcopy(trainer.algorithm), "", tf.get_logger()
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


def check_path(value: Any, name: str = "directory", kind: str = "a path") -> str:
    """``value`` as a ``str``; a ``TypeError`` naming ``name`` if it is not a path."""
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise TypeError(f"{name} must be {kind} (str or os.PathLike); got {value!r}")
    return str(value)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    manifest = {p.name: [p.stat().st_size, _digest(p)] for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for p in [*files, folder / MANIFEST]:
        _fsync(p)
    _fsync(folder)


def write(trainer: Trainer, directory: Any, number: int, position: dict[str, Any],
          keep: int | None = 3) -> str:  # fmt: skip
    """Save the trainer's state as ``directory/ckpt-<number>`` atomically, as drawn above,
    with ``position`` (JSON); keep the ``keep`` newest (None: all). Return its prefix."""
    non_negative_int("number", number)
    optional(positive_int, "keep", keep)
    root = Path(check_path(directory))
    root.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{number:08d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    checkpoint(trainer).write(str(tmp / PREFIX))
    (tmp / POSITION).write_text(json.dumps(position, sort_keys=True))
    _write_manifest(tmp)
    older = [(k, p) for (n, k), p in _folders(root) if n == number]
    final = root / (f"{name}.{1 + max(k for k, _ in older)}" if older else name)
    os.rename(tmp, final)
    _fsync(root)
    pointer = root / f".{POINTER}.tmp"
    pointer.write_text(final.name + "\n")
    _fsync(pointer)
    os.replace(pointer, root / POINTER)
    _fsync(root)
    for _, old in older:  # replaced: only now that the new save is complete and in place
        shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        for stale in checkpoints(root)[:-keep]:
            shutil.rmtree(Path(stale).parent, ignore_errors=True)
    return str(final / PREFIX)


def checkpoints(directory: Any) -> list[str]:
    """The prefixes of every ``ckpt-*`` in ``directory``, oldest first (unverified)."""
    return [str(p / PREFIX) for _, p in _folders(Path(check_path(directory)))]


def _folders(root: Path) -> list[tuple[tuple[int, int], Path]]:
    """``((N, k), folder)`` of each ``ckpt-N`` (k = 0) and ``ckpt-N.k`` of ``root``, by age."""
    if not root.is_dir():
        return []
    found = [(_NAME.match(p.name), p) for p in root.iterdir()]
    return sorted(((int(m[1]), int(m[2] or 0)), p) for m, p in found if m)


def verify(prefix: Any) -> dict[str, Any]:
    """Check a checkpoint written by :func:`write` against its manifest; return its position
    (``CheckpointError``: no manifest or position, a file missing, truncated or corrupt)."""
    prefix = check_path(prefix, "prefix")
    folder = Path(prefix).parent
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        for name, (size, digest) in manifest.items():
            path = folder / name
            if not path.is_file():
                raise CheckpointError(prefix, f"{name} is missing")
            if path.stat().st_size != size:
                raise CheckpointError(prefix, f"{name} has {path.stat().st_size} bytes, its "
                                      f"manifest {size} (truncated?)")  # fmt: skip
            if _digest(path) != digest:
                raise CheckpointError(prefix, f"{name} does not match its sha256 (corrupt)")
        position: dict[str, Any] = json.loads((folder / POSITION).read_text())
    except (OSError, ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(prefix, f"manifest or position unreadable ({err})") from err
    return position


def latest(directory: Any) -> str | None:
    """The prefix of the newest checkpoint in ``directory`` that verifies, or None; a
    damaged newer one is skipped with a ``RuntimeWarning``."""
    for prefix in reversed(checkpoints(directory)):
        try:
            verify(prefix)
        except CheckpointError as err:
            warnings.warn(f"skipping a damaged checkpoint: {err}", RuntimeWarning, stacklevel=2)
            continue
        return prefix
    return None
