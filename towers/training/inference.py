"""The towers' inference pass of ``evaluate`` and ``predict``: no tape, no update.

::

    batch ─split─▶ shard_i ─tf.device(tower_i): replica_i.model(shard_i, training=False)─▶ out_i
          ─▶ concat(out_0 … out_{n-1}) on the parameter device, in tower order

The split is the step's own (:func:`towers.split.shard_batch`); an empty tower sits out.
"""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.primitives import send
from towers.split import Batch, concat, shard_batch
from towers.tower import per_example_loss
from towers.training.protocol import Trainer
from towers.training.shapes import RelaxedBatch

__all__ = ["inference"]


class _Inference:
    """A trainer's compiled inference passes (traced once per batch shape): the step's
    split (:func:`towers.split.shard_batch`), then every tower's replica on its shard in
    inference mode, outputs concatenated in tower order on the parameter device.

    Holds the trainer weakly so that the cache below does not keep it alive.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = weakref.ref(trainer)
        self.outputs = tf.function(self._outputs, autograph=False)
        self.loss_and_outputs = tf.function(self._loss_and_outputs, autograph=False)
        # evaluate on a dataset of unknown batch size: traced as Keras traces (shapes.py)
        self.relaxed_loss_and_outputs = RelaxedBatch(
            tf.function(self._loss_and_outputs, autograph=False))

    def _get(self) -> Trainer:
        trainer = self._trainer()
        assert trainer is not None
        return trainer

    def _run(self, batch: Batch) -> list[tuple[str, Batch, Any]]:
        """``(device, shard, outputs)`` of every tower that has examples, in tower order."""
        trainer = self._get()
        shards = shard_batch(*batch, len(trainer.devices))
        done = []
        for i, (size, shard) in enumerate(zip(shards.sizes, shards.parts)):
            if size == 0:  # Conv2D (and others) fail on 0 rows: an empty tower sits out
                continue
            device = trainer.devices[i]
            with tf.device(device):
                done.append((device, shard, trainer.replica_of(i).model(shard[0], training=False)))
        return done

    def _outputs(self, x: Any) -> Any:
        outputs = [out for _, _, out in self._run((x, None, None))]
        return concat(outputs, self._get().parameter_device)

    def _loss_and_outputs(self, x: Any, y: Any, sample_weight: Any) -> tuple[tf.Tensor, Any]:
        """``(Σ w·l over the batch, outputs)``: each tower sums its own losses."""
        trainer = self._get()
        done = self._run((x, y, sample_weight))
        sums = []
        for device, shard, out in done:
            with tf.device(device):
                per_ex = per_example_loss(trainer.loss_fn, shard[1], out)
                if sample_weight is not None:
                    per_ex = per_ex * tf.cast(shard[2], per_ex.dtype)
                sums.append(tf.reduce_sum(per_ex))
        home = trainer.parameter_device
        with tf.device(home):
            total = tf.add_n([send(s, home, note="loss") for s in sums])
        return total, concat([out for _, _, out in done], home)


_CACHE: weakref.WeakKeyDictionary[Any, _Inference] = weakref.WeakKeyDictionary()


def inference(trainer: Trainer) -> _Inference:
    """The trainer's compiled inference passes (made once per trainer)."""
    if trainer not in _CACHE:
        _CACHE[trainer] = _Inference(trainer)
    return _CACHE[trainer]
