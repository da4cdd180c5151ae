"""Checkpoints of a multi-worker run: written once, by the chief, atomically; read by all.

Every worker holds the same weights after a synchronous step, so one copy is enough;
the chief writes it (``Cluster.is_chief``: task ``chief:0``, else ``worker:0``) and the
other workers write nothing. A crash mid-write must never leave a checkpoint that
looks complete, so the chief writes into a temporary directory and renames it::

    directory/
      .tmp-ckpt-12-<pid>/state.*   1. towers.training.checkpoint.save into a fresh temp dir
      ckpt-12/state.*              2. os.replace(temp dir, ckpt-12)     (atomic rename)
      LATEST  = "ckpt-12"          3. write LATEST.tmp, os.replace → LATEST (atomic)

    restart: every worker reads LATEST → restores ckpt-12/state → the same bits everywhere
             → continues at step 12 (what Keras' BackupAndRestore does for model.fit)

A reader sees the previous ``LATEST`` or the new one, each naming a finished
checkpoint; a ``ckpt-*`` without ``LATEST`` pointing at it is ignored.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from towers.cluster.spec import resolve
from towers.training.checkpoint import restore, save
from towers.training.protocol import Trainer

__all__ = ["LATEST", "latest", "restore_latest", "save_on_chief"]

LATEST = "LATEST"
"""File in the checkpoint directory naming the newest complete checkpoint."""
_STATE = "state"


def save_on_chief(trainer: Trainer, directory: str, cluster: Any = None) -> str | None:
    """On the chief, write the trainer's state as ``directory/ckpt-<step>``; elsewhere nothing.

    Args:
        trainer: this worker's trainer (all workers hold the same state).
        directory: the run's checkpoint directory (shared by every worker).
        cluster: anything :func:`towers.cluster.resolve` takes (default: TF_CONFIG).

    Returns:
        The checkpoint's directory on the chief; None on every other worker.

    Example:
        >>> if step % 10 == 0:                                      # doctest: +SKIP
        ...     save_on_chief(trainer, "/tmp/run")
    """
    if not resolve(cluster).is_chief:
        return None
    os.makedirs(directory, exist_ok=True)
    name = f"ckpt-{int(trainer.optimizer.iterations.numpy())}"
    final = os.path.join(directory, name)
    temp = os.path.join(directory, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    os.makedirs(temp)
    save(trainer, os.path.join(temp, _STATE))
    if os.path.exists(final):  # the same step saved before (a resumed run): replace it
        shutil.rmtree(final)
    os.replace(temp, final)
    pointer = os.path.join(directory, f"{LATEST}.tmp-{os.getpid()}")
    with open(pointer, "w", encoding="utf-8") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(directory, LATEST))
    return final


def latest(directory: str) -> str | None:
    """The prefix of the newest complete checkpoint in ``directory``, or None.

    Raises:
        ValueError: ``LATEST`` names a checkpoint that is not there (the directory was
            tampered with).
    """
    try:
        with open(os.path.join(directory, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    found = os.path.join(directory, name)
    if not name.startswith("ckpt-") or not os.path.isdir(found):
        raise ValueError(f"{directory}/{LATEST} names {name!r}, which is not a checkpoint here")
    return os.path.join(found, _STATE)


def restore_latest(trainer: Trainer, directory: str) -> int:
    """On every worker, restore the newest checkpoint of ``directory``; return its step.

    Returns:
        The optimizer's iteration count after restoring (0 when there is no checkpoint:
        the trainer is unchanged and the run starts from the beginning).

    Raises:
        towers.CheckpointError: the checkpoint does not fit this trainer, or is corrupt.
    """
    prefix = latest(directory)
    if prefix is None:
        return 0
    restore(trainer, prefix)
    return int(trainer.optimizer.iterations.numpy())
