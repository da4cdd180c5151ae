"""The towers' inference pass of ``evaluate`` and ``predict``: no tape, no update.

::

    Keras evaluate ─▶ test_batch:     loss_and_outputs ─▶ loss / divisor (+ model losses)
    Keras predict  ─▶ predict_batches: outputs of each batch, concatenated

    batch ─split─▶ shard_i ─tf.device(tower_i): network(replica_i's values, shard_i)─▶ out_i
          ─▶ concat(out_0 … out_{n-1}) on the parameter device, in tower order

The split and the network call are the training step's (:func:`towers.split.shard_batch`,
:func:`towers.tower.run_network`), in inference mode; an empty tower sits out.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.allreduce.machinery.primitives import send
from towers.compile.relaxed import RelaxedBatch
from towers.split import Batch, concat, relaxes, shard_batch
from towers.tower import loss_divisor, per_example_loss, run_network, weighs_elements
from towers.training.protocol import Trainer

__all__ = ["inference", "predict_batches", "test_batch"]


class _Inference:
    """A trainer's compiled inference passes; holds the trainer weakly (for the cache)."""

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

    def _run(self, batch: Batch) -> list[tuple[str, Batch, Any, list[Any]]]:
        """``(device, shard, outputs, model losses)`` of every tower with examples, in order."""
        trainer = self._get()
        shards = shard_batch(*batch, len(trainer.devices))
        done = []
        for i, (size, shard) in enumerate(zip(shards.sizes, shards.parts)):
            if size == 0:  # Conv2D (and others) fail on 0 rows: an empty tower sits out
                continue
            device = trainer.devices[i]
            trainable, frozen = trainer.replicas.read(i, device)
            with tf.device(device):
                out, _, losses = run_network(trainer.model, trainable, frozen, shard[0], False)
                done.append((device, shard, out, list(losses)))
        return done

    def _outputs(self, x: Any) -> Any:
        outputs = [out for _, _, out, _ in self._run((x, None, None))]
        return concat(outputs, self._get().parameter_device)

    def _loss_and_outputs(self, x: Any, y: Any, sample_weight: Any
                          ) -> tuple[tf.Tensor, Any, tf.Tensor]:  # fmt: skip
        """``(Σ w·l over the batch, outputs, model losses)``; the model's losses R_i
        (``add_loss``, regularizers) averaged over the towers by their examples b_i,
        Σ R_i·b_i / Σ b_i, as MirroredStrategy's loss tracker reports."""
        trainer = self._get()
        done = self._run((x, y, sample_weight))
        sums, extra, examples = [], [], []
        for device, shard, out, losses in done:
            with tf.device(device):
                per_ex = per_example_loss(trainer.loss_fn, shard[1], out, shard[2],
                                          reduction=trainer.loss_reduction)
                if sample_weight is not None and not weighs_elements(shard[2]):
                    per_ex = per_ex * tf.cast(shard[2], per_ex.dtype)
                sums.append(tf.reduce_sum(per_ex))
                b = tf.cast(tf.shape(per_ex)[0], per_ex.dtype)
                examples.append(b)
                if losses:
                    extra.append(tf.add_n([tf.cast(r, per_ex.dtype) for r in losses]) * b)
        home = trainer.parameter_device
        with tf.device(home):
            total = tf.add_n([send(s, home, note="loss") for s in sums])
            model_loss = (tf.add_n([send(r, home, note="loss") for r in extra])
                          / tf.add_n([send(b, home, note="loss") for b in examples]) if extra
                          else tf.zeros([], total.dtype))  # fmt: skip
        return total, concat([out for _, _, out, _ in done], home), model_loss


_CACHE: weakref.WeakKeyDictionary[Any, _Inference] = weakref.WeakKeyDictionary()


def inference(trainer: Trainer) -> _Inference:
    """The trainer's compiled inference passes (made once per trainer)."""
    if trainer not in _CACHE:
        _CACHE[trainer] = _Inference(trainer)
    return _CACHE[trainer]


def test_batch(tm: Any, data: Any, *, batch_unknown: bool = False) -> dict[str, Any]:
    """``TowerModel``'s evaluation of one batch: the global mean loss and the metrics' logs."""
    trainer = tm._trainer()
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    passes = inference(trainer)
    relaxed = relaxes(batch_unknown, x, len(trainer.devices))
    total, outputs, model_loss = (passes.relaxed_loss_and_outputs if relaxed
                                  else passes.loss_and_outputs)(x, y, sample_weight)  # fmt: skip
    size = tf.shape(tf.nest.flatten(x)[0])[0]
    weights = [] if sample_weight is None else [sample_weight]
    divisor = loss_divisor(trainer.loss_reduction, size, weights, trainer.parameter_device)
    # the model's losses come out of the traced pass: model.losses read here, outside it,
    # would hold that graph's tensors (add_loss, activity regularizers)
    loss = total / tf.cast(divisor, total.dtype) + model_loss
    return tm._update_metrics(x, y, outputs, sample_weight, loss)  # type: ignore[no-any-return]


def predict_batches(trainer: Trainer, data: Sequence[Any]) -> Any:
    """``TowerModel``'s prediction: the towers' outputs on each batch, concatenated."""
    outs = []
    for batch in data:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        outs.append(inference(trainer).outputs(x))
    if len(outs) == 1:
        return outs[0]
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outs)
