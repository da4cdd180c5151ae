"""``ExactResume``: save every k batches, and resume at the exact batch where a run died.

::

    tm.fit(x, y, shuffle=False, callbacks=[ExactResume(d, every=k)])
      on_train_begin: latest(d) ─▶ none: train from scratch
                               └▶ ckpt-N: restore every replica, slots, iterations,
                                  all-reduce state; position = (epoch e, batch b)
                                  fit starts at epoch e; the train function skips
                                  batches 0 … b-1 of it (pulled, not trained)
      after each trained batch: N += 1; N % k == 0 ─▶ write ckpt-N atomically
                                (k None: at the end of every epoch instead)

Unlike Keras's ``BackupAndRestore`` (which trains an epoch's first batches twice), the
resumed run ends bitwise as the uninterrupted one, given the same batches in every epoch.
"""

from __future__ import annotations

from typing import Any

import keras

from towers.guard.arguments import check_bool, optional, positive_int
from towers.guard.errors import CheckpointError
from towers.training.checkpoint import check_path, latest, restore, verify, write

__all__ = ["ExactResume", "data_facts"]

_FACTS = {"kind": "data", "batch_size": "batch_size", "examples": "examples",
          "shuffle": "shuffle", "steps": "batches per epoch"}  # fmt: skip


def data_facts(x: Any, batch_size: int | None, shuffle: Any) -> dict[str, Any]:
    """The kind, batch size, examples and shuffle of ``fit``'s ``x``: what a position counts in."""
    first = keras.tree.flatten(x)[0] if x is not None else None
    if first is None or not hasattr(first, "shape") or not hasattr(first, "__len__"):
        return {"kind": "dataset", "batch_size": None, "examples": None, "shuffle": None}
    return {"kind": "arrays", "batch_size": batch_size or 32, "examples": int(first.shape[0]),
            "shuffle": bool(shuffle)}  # fmt: skip


def check_position(prefix: str, position: dict[str, Any], facts: dict[str, Any]) -> None:
    """A ``CheckpointError`` naming the first of ``facts`` that differs from ``position``'s."""
    saved = position.get("data")
    if not isinstance(saved, dict):
        raise CheckpointError(prefix, "its position does not record the data and batch size "
                              "it counts in (written by an older towers): it cannot be resumed "
                              "exactly; start the run in a new directory")  # fmt: skip
    for key, name in _FACTS.items():
        if saved.get(key) != facts[key]:
            raise CheckpointError(
                prefix, f"was written by a fit with {name}={saved.get(key)!r}, this fit has "
                f"{name}={facts[key]!r}: its position (epoch {position.get('epoch')}, "
                f"{position.get('batch')} batches of it trained) counts batches of that fit's "
                f"data, so resuming would skip or repeat examples. Resume with {name}="
                f"{saved.get(key)!r}, or start the run in a new directory")  # fmt: skip


class ExactResume(keras.callbacks.Callback):
    """Atomic checksummed checkpoints every ``every`` batches and an exact resume, for a
    :class:`towers.TowerModel`.

    Args:
        directory: the run's checkpoint directory (created if missing).
        every: save after every ``every`` trained batches, counted over the whole run
            (None: at the end of every epoch).
        keep: how many of the newest checkpoints to keep.
        resume: first restore the directory's latest good checkpoint.

    Raises:
        TypeError, ValueError: a bad argument; at ``fit``: not a TowerModel, or
            arrays with ``shuffle=True``.
        CheckpointError: at ``fit``: the latest checkpoint does not fit this model or data.

    Example:
        >>> tm.fit(x, y, batch_size=96, epochs=3, shuffle=False,          # doctest: +SKIP
        ...        callbacks=[ExactResume("runs/a", every=4)])
    """

    def __init__(self, directory: Any, every: int | None = None, keep: int = 3,
                 resume: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.directory, self.every = check_path(directory), optional(positive_int, "every", every)
        self.keep, self.resume = positive_int("keep", keep), check_bool("resume", resume)
        self.batches = 0  # batches trained over the whole run, resumed ones included
        self.epoch, self.done, self.skip = 0, 0, (-1, 0)
        self.data: dict[str, Any] = {}

    def on_train_begin(self, logs: Any = None) -> None:
        """Check the model and data; restore the latest good checkpoint, if any."""
        facts = getattr(self.model, "fit_facts", None)
        if facts is None or getattr(self.model, "trainer", None) is None:
            raise ValueError("ExactResume must be a callback of a compiled towers.TowerModel's "
                             f"fit, got a {type(self.model).__name__}")  # fmt: skip
        facts = facts()
        if facts["shuffle"]:
            raise ValueError(
                "shuffle must be False with ExactResume and array data: Keras shuffles arrays "
                "afresh in each process, so a resumed epoch would train other batches. "
                "Shuffle the arrays once beforehand (seeded), or pass a dataset")  # fmt: skip
        self.data = {**facts, "steps": self.params.get("steps")}
        self.batches, self.skip = 0, (-1, 0)
        prefix = latest(self.directory) if self.resume else None
        if prefix is None:
            return
        position = verify(prefix)
        check_position(prefix, position, self.data)
        restore(self.model.trainer, prefix)
        self.batches = int(position["batches"])
        self.skip = (int(position["epoch"]), int(position["batch"]))
        self.model._initial_epoch, self.model.resume_skip = self.skip  # as BackupAndRestore

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch
        self.done = self.skip[1] if epoch == self.skip[0] else 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        """Count the batches trained up to ``batch`` (skipped ones not); save when due."""
        if batch + 1 <= self.done:  # a batch the resume skipped
            return
        before, self.batches = self.batches, self.batches + batch + 1 - self.done
        self.done = batch + 1
        if self.every is not None and self.batches // self.every > before // self.every:
            self.save(self.epoch, self.done)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.every is None:
            self.save(epoch + 1, 0)

    def on_train_end(self, logs: Any = None) -> None:
        """Leave the model as Keras made it: the next ``fit`` starts where it is told."""
        self.model._initial_epoch, self.model.resume_skip = None, 0

    def save(self, epoch: int, batch: int) -> str:
        """Write ``ckpt-<batches>``: the trainer's state and where the data stream stands."""
        steps = self.data.get("steps")
        if steps is not None and batch >= steps:  # the epoch is done: resume at the next
            epoch, batch = epoch + 1, 0
        position = {"epoch": epoch, "batch": batch, "batches": self.batches, "data": self.data}
        return write(self.model.trainer, self.directory, self.batches, position, self.keep)
