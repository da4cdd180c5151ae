"""Checkpoints of a multi-worker run: written once, by the chief, atomically; read by all.

Every worker holds the same weights after a synchronous step, so one copy is enough;
the chief writes it (``Cluster.is_chief``: task ``chief:0``, else ``worker:0``) and the
other workers write nothing. The directory is the one ``ExactResume(directory)`` keeps
(:mod:`towers.training.atomic`: a temporary folder, a manifest of sizes and sha256,
fsync, an atomic rename, the ``latest`` pointer; a re-save of a number deletes the old
folder only once the new one is in place)::

    step k (0-based) trained ─▶ steps taken = k + 1 ─▶ chief: ckpt-<k + 1> ("steps": k + 1)
    restart: every worker: latest good ckpt-N ─▶ restore (the same bits everywhere)
             ─▶ returns N: the loop goes on with step N, batch N

Checkpoints are numbered by the steps TAKEN, counted by the loop, not by
``optimizer.iterations``: a step the non-finite guard skipped (or a loss-scale overflow)
does not advance ``iterations``, so keyed on it a resumed run would train a batch twice,
and the chief would save the same number again.
"""

from __future__ import annotations

from typing import Any

from towers.cluster.spec import resolve
from towers.guard.errors import CheckpointError
from towers.training import atomic
from towers.training.checkpoint import checkpoint, restore
from towers.training.protocol import Trainer

__all__ = ["restore_latest", "save_on_chief"]


def save_on_chief(
    trainer: Trainer, directory: str, steps: int, cluster: Any = None, keep: int | None = None
) -> str | None:
    """On the chief, write the trainer's state as ``directory/ckpt-<steps>``; elsewhere nothing.

    Args:
        trainer: this worker's trainer (all workers hold the same state).
        directory: the run's checkpoint directory (shared by every worker).
        steps: the steps taken so far, skipped ones included (after step ``k``: ``k + 1``);
            :func:`restore_latest` returns it, the step to go on with.
        cluster: anything :func:`towers.cluster.resolve` takes (default: TF_CONFIG).
        keep: how many of the newest checkpoints to keep (None: all).

    Returns:
        The checkpoint's prefix on the chief; None on every other worker.

    Raises:
        ValueError: ``steps`` is not an int >= 0, or ``keep`` not None or an int >= 1.

    Example:
        >>> save_on_chief(trainer, "/tmp/run", step + 1)            # doctest: +SKIP
    """
    if not resolve(cluster).is_chief:
        return None
    return atomic.write(checkpoint(trainer), directory, steps, {"steps": steps}, keep)


def restore_latest(trainer: Trainer, directory: str) -> int:
    """On every worker, restore the newest good checkpoint of ``directory``; return its steps.

    Returns:
        The steps taken when it was saved: the index of the next step to run (0 when
        there is no checkpoint: the trainer is unchanged and the run starts afresh).

    Raises:
        towers.CheckpointError: the checkpoint does not fit this trainer, or is corrupt
            (the trainer is unchanged).

    Example:
        >>> start = restore_latest(trainer, "/tmp/run")             # doctest: +SKIP
    """
    prefix = atomic.latest(directory)
    if prefix is None:
        return 0
    position = atomic.verify(prefix)
    steps = position.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise CheckpointError(prefix, "its position holds no count of steps taken (not written "
                              "by save_on_chief): the step to go on with is unknown")  # fmt: skip
    restore(trainer, prefix)
    return steps
