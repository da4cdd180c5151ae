"""``fit(checkpoint_dir=...)``: save every k batches, and resume exactly where a run died.

::

    fit(..., checkpoint_dir=d, checkpoint_every=k)      (resume=True, the default)
      start:  latest(d) ─▶ none: train from scratch
                        └▶ ckpt-N: restore every replica, slots, iterations, all-reduce
                                   state; position = (epoch e, batch b, shuffle state)
      epoch e: shuffle with the saved generator state ─▶ skip batches 0 … b-1
      after each trained batch: N += 1; N % k == 0 ─▶ write ckpt-N atomically
                                (k None: at the end of every epoch instead)

The position counts batches, so it means something only for the data and batch size it
was written with: ``position.json`` also records them (``data``: batch size, number of
examples, shuffling, batches per epoch), and a resume with any other is refused before
the trainer changes — it would skip or repeat examples.

The position is part of the checkpoint, so the resumed run trains the very batches,
in the very order, that the uninterrupted run would have: its final weights,
optimizer slots and ``iterations`` are bitwise the same (tests/training/test_resume.py
kills a run with SIGKILL at random moments to check it). The shuffling generator's
state is the one at the start of the epoch (its permutation is drawn again), so a
NumPy ``default_rng(seed)`` stream continues unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from towers.guard.arguments import optional, positive_int
from towers.guard.errors import CheckpointError
from towers.training import atomic
from towers.training.checkpoint import checkpoint, restore
from towers.training.protocol import Trainer
from towers.training.sources import Source

__all__ = ["Backup", "data_facts"]

_FACTS = (
    ("kind", "data"),
    ("batch_size", "batch_size"),
    ("examples", "examples"),
    ("shuffle", "shuffle"),
    ("steps", "batches per epoch"),
)


def data_facts(train: Source, shuffle: bool) -> dict[str, Any]:
    """What a saved position counts in: the data's kind and size, batch size, shuffling.

    Args:
        train: ``fit``'s training data.
        shuffle: ``fit(shuffle=...)`` (array data only: a dataset shuffles itself).

    Returns:
        ``{"kind", "batch_size", "examples", "shuffle", "steps"}`` (None where unknown,
        e.g. a dataset's batch size: it is batched already).
    """
    if train.arrays is None:
        return {"kind": "dataset", "batch_size": None, "examples": None, "shuffle": None,
                "steps": train.steps}  # fmt: skip
    examples = int(np.shape(tf.nest.flatten(train.arrays[0])[0])[0])
    return {"kind": "arrays", "batch_size": train.batch_size, "examples": examples,
            "shuffle": bool(shuffle), "steps": train.steps}  # fmt: skip


def check_position(prefix: str, position: dict[str, Any], facts: dict[str, Any]) -> None:
    """Refuse to resume from ``position`` with data described by other ``facts``.

    Raises:
        CheckpointError: naming both values of the first fact that differs (or a position
            that records none: written before positions recorded their data).
    """
    saved = position.get("data")
    if not isinstance(saved, dict):
        raise CheckpointError(prefix, "its position does not record the data and batch size "
                              "it counts in (written by an older towers): it cannot be resumed "
                              "exactly; start the run in a new checkpoint_dir")  # fmt: skip
    for key, name in _FACTS:
        if saved.get(key) != facts[key]:
            raise CheckpointError(
                prefix, f"was written by a fit with {name}={saved.get(key)!r}, this fit has "
                f"{name}={facts[key]!r}: its position (epoch {position.get('epoch')}, "
                f"{position.get('batch')} batches of it trained) counts batches of that fit's "
                f"data, so resuming would skip or repeat examples. Resume with {name}="
                f"{saved.get(key)!r}, or start the run in a new checkpoint_dir",
            )  # fmt: skip


class Backup:
    """The checkpoint side of ``fit``: where to resume, and a save every ``every`` batches.

    Args:
        trainer: the trainer ``fit`` trains.
        directory: the run's checkpoint directory.
        every: save after every ``every`` trained batches (None: after every epoch).
        keep: how many of the newest checkpoints to keep.
        data: :func:`data_facts` of the data ``fit`` reads (saved with every position,
            compared on resume).

    Raises:
        TypeError: ``directory`` is not a path (named ``checkpoint_dir``, as in ``fit``).
        ValueError: ``every`` is not None or an int >= 1, or ``keep`` not an int >= 1.
    """

    def __init__(
        self, trainer: Trainer, directory: Any, every: int | None, keep: int,
        data: dict[str, Any],
    ) -> None:  # fmt: skip
        atomic.check_directory(directory, "checkpoint_dir")
        optional(positive_int, "checkpoint_every", every)
        positive_int("checkpoint_keep", keep)
        self.trainer, self.directory, self.every, self.keep = trainer, directory, every, keep
        self.data = data
        self.batches = 0  # batches trained over the whole run, resumed ones included
        self.epoch_rng: Any = None

    def resume(self, rng: np.random.Generator | None) -> tuple[int, int]:
        """Restore the latest good checkpoint, if any; return ``(epoch, batches to skip)``.

        Raises:
            CheckpointError: the latest checkpoint does not fit this trainer, or its
                position another batch size or data (the trainer is unchanged).
        """
        prefix = atomic.latest(self.directory)
        if prefix is None:
            return 0, 0
        position = atomic.verify(prefix)
        check_position(prefix, position, self.data)
        restore(self.trainer, prefix)
        self.batches = int(position["batches"])
        if rng is not None and position.get("rng") is not None:
            rng.bit_generator.state = position["rng"]
        return int(position["epoch"]), int(position["batch"])

    def epoch_begins(self, rng: np.random.Generator | None) -> None:
        """Remember the shuffling state the epoch starts from (saved with every checkpoint)."""
        self.epoch_rng = None if rng is None else rng.bit_generator.state

    def batch_done(self, epoch: int, batch: int) -> None:
        """Count a trained batch (index ``batch`` of ``epoch``); save when one is due."""
        self.batches += 1
        if self.every is not None and self.batches % self.every == 0:
            self.save(epoch, batch + 1)

    def epoch_done(self, epoch: int, rng: np.random.Generator | None) -> None:
        """With ``every=None``, save at the end of each epoch (the next one's shuffling state)."""
        if self.every is None:
            self.epoch_begins(rng)
            self.save(epoch + 1, 0)

    def save(self, epoch: int, batch: int) -> str:
        """Write ``ckpt-<batches>``: the trainer's state and where the data stream stands."""
        position = {"epoch": epoch, "batch": batch, "batches": self.batches,
                    "rng": self.epoch_rng, "data": self.data}  # fmt: skip
        return atomic.write(
            checkpoint(self.trainer), self.directory, self.batches, position, self.keep
        )
