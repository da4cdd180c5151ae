"""``TowerModel``: the Keras face of the step — ``compile``/``fit`` run the towers step.

::

    keras fit/evaluate/predict loop      (data adapters, callbacks, progress bar, History)
          │  steps_per_execution batches per call of a Keras function
          ▼
    train_batch ─▶ trainer.train_step_as_keras(x, y, w, batch_unknown)   towers/step.py
    test_batch, predict_batches: the towers' inference pass   towers/training/inference.py
          ▼
    loss tracker ← the step's global mean loss; compiled metrics ← the step's own outputs

A real ``keras.Model`` wrapping the user's model (:attr:`network`, replica 0's copy);
``compile`` builds the :class:`~towers.TowerTrainer`. Writes reach every replica:
``set_weights``/``load_weights``, every ``fit``/``evaluate``/``predict`` and every epoch's
first step broadcast replica 0 (a callback's write lands too); a callback's change of a
hyperparameter or of ``layer.trainable`` is followed (:mod:`towers.placement`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.guard.arguments import naming
from towers.guard.given import check_devices
from towers.guard.inputs import check_keras_steps
from towers.guard.options import TowerOptions
from towers.placement import get_placement
from towers.split import batch_unknown
from towers.step import TowerTrainer
from towers.training.backup import data_facts
from towers.training.export import AsNetwork, tower_model_arguments, tower_model_config
from towers.training.inference import predict_batches, test_batch
from towers.training.keras_copies import new_model
from towers.training.losses import OutputLosses, is_structured

__all__ = ["TowerModel"]

_KERAS_KWARGS = ("trainable", "dtype")
"""``keras.Model`` arguments a config may carry beside the towers options."""


@keras.saving.register_keras_serializable(package="towers")
class TowerModel(keras.Model):
    """A ``keras.Model`` whose ``fit``/``evaluate``/``predict`` run over explicit towers.

    Args:
        model: a built ``keras.Model`` (or a zero-argument factory returning one): the
            network every tower runs; its variables become replica 0's.
        devices: the towers' devices (default: every local logical device).
        name: the Keras model's name.
        **options: the trainer's :class:`~towers.guard.options.TowerOptions`, each checked
            here (their combination at ``compile``).

    Raises TypeError or ValueError for a wrong model, device list or option (naming it).

    Example:
        >>> tm = towers.TowerModel(model, devices=devices, variables="replicated",
        ...                        all_reduce="ring")                   # doctest: +SKIP
        >>> tm.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
        >>> history = tm.fit(x, y, batch_size=64, epochs=3, validation_split=0.1)
    """

    def __init__(self, model: keras.Model | Any, devices: Sequence[str] | None = None,
                 name: str | None = None, **options: Any) -> None:  # fmt: skip
        keras_kwargs = {k: options.pop(k) for k in _KERAS_KWARGS if k in options}
        super().__init__(name=name, **keras_kwargs)
        self.options = TowerOptions.of("TowerModel", options)
        placement = naming("variables", lambda: get_placement(self.options.variables))
        self.devices = naming("devices", lambda: check_devices(devices))
        given = self.options.parameter_device
        pd = naming("parameter_device", lambda: check_devices([given or self.devices[0]])[0])
        self.network = new_model(model, placement.homes(self.devices, pd)[0], None)
        # a factory makes the other replicas too (a subclassed model may not clone)
        self._factory: Callable[[], keras.Model] | None = (
            None if isinstance(model, keras.Model) else model)
        check_keras_steps(self.network)
        if len(getattr(self.network, "output_names", None) or []) > 1:
            # Keras's compile reads them: per-output metric names ("a_accuracy", "b_loss")
            self.output_names = list(self.network.output_names)
        self.trainer: TowerTrainer | None = None
        self.fit_facts: Any = None  # () -> what ExactResume records and checks, during fit
        self.resume_skip = 0  # batches the train function pulls but does not train
        self.broadcast_pending = False  # broadcast again before the next step (reset_metrics)
        self.built = True

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The wrapped network on one device (Keras's symbolic build and a plain call)."""
        return self.network(inputs, training=training)

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, loss_weights: Any = None,
                metrics: Any = None, weighted_metrics: Any = None, run_eagerly: bool = False,
                steps_per_execution: int = 1, jit_compile: Any = "auto",
                auto_scale_loss: bool = True) -> None:  # fmt: skip
        """Keras's ``compile``, then the :class:`~towers.TowerTrainer` for this optimizer and loss.

        Raises:
            ValueError: no loss, losses or ``loss_weights`` that do not match the outputs,
                ``jit_compile=True`` (``TowerModel(jit_compile=True)`` is XLA for the
                towers), or options the capability table refuses together.
            TypeError: ``loss_weights`` that is not a list or a dict.
        """
        if loss is None:
            raise ValueError("loss must be a Keras loss, loss name or callable (or one per "
                             "output: a list or a dict by output name) for TowerModel, got None")
        if loss_weights is not None and not is_structured(loss_weights):
            raise TypeError("loss_weights must be a list or a dict by output name, got "
                            f"{loss_weights!r}")  # fmt: skip
        per_output = is_structured(loss) or loss_weights is not None
        trainer_loss = OutputLosses(loss, loss_weights) if per_output else loss
        if jit_compile is True:
            raise ValueError("jit_compile must be False or 'auto' in TowerModel.compile, got "
                             "True: XLA for the towers is TowerModel(..., jit_compile=True)")
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics,
                        weighted_metrics=weighted_metrics, run_eagerly=run_eagerly,
                        steps_per_execution=steps_per_execution, jit_compile=False,
                        auto_scale_loss=auto_scale_loss)  # fmt: skip
        compiled: Any = self.optimizer  # type: ignore[has-type]  # Keras sets it untyped
        self.trainer = TowerTrainer(self._replicas(), compiled, trainer_loss,
                                    devices=self.devices, **self.options.arguments())  # fmt: skip
        first: Any = self.trainer.optimizer
        if first is not compiled:  # it was built already: the trainer made a copy
            self.optimizer = first
        # sharded: every owner's optimizer holds its own shard's slots; tracked so that
        # save_weights/load_weights carry them all
        self.shard_optimizers = ([r.optimizer for r in self.trainer.replicas[1:]]
                                 if self.trainer.placement.name == "sharded" else [])

    def _replicas(self) -> Any:
        """The network, or a factory handing out the network first, then the user's models."""
        factory = self._factory
        if factory is None:
            return self.network
        handed = [self.network]

        def replica() -> keras.Model:
            return handed.pop() if handed else factory()

        return replica

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compile from a saved compile config (``keras.models.load_model``), trainer included."""
        self.compile(**keras.saving.deserialize_keras_object(config))

    def _trainer(self) -> TowerTrainer:
        if self.trainer is None:
            raise RuntimeError("TowerModel must be compiled before training, evaluating or "
                               "predicting: call tm.compile(optimizer, loss)")
        return self.trainer

    def fit(
        self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
        verbose: Any = "auto", callbacks: Any = None, validation_split: float = 0.0,
        validation_data: Any = None, shuffle: Any = True, class_weight: Any = None,
        sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
        validation_steps: int | None = None, validation_batch_size: int | None = None,
        validation_freq: int = 1,
    ) -> keras.callbacks.History:
        """Keras's ``fit``, recording the data's facts for ``ExactResume``."""
        self.fit_facts = functools.partial(data_facts, x, batch_size, shuffle)
        try:
            return super().fit(
                x=x, y=y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                callbacks=callbacks, validation_split=validation_split,
                validation_data=validation_data, shuffle=shuffle, class_weight=class_weight,
                sample_weight=sample_weight, initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                validation_batch_size=validation_batch_size, validation_freq=validation_freq,
            )  # fmt: skip
        finally:
            self.fit_facts, self.resume_skip = None, 0

    # -- the Keras functions: one towers step (or inference pass) per batch -----------------

    def make_train_function(self, force: bool = False) -> Any:
        """One towers step per batch (``steps_per_execution`` batches per call)."""
        self.broadcast()
        self.train_function = self._per_batch(self._train_batch)
        return self.train_function

    def make_test_function(self, force: bool = False) -> Any:
        """The towers' inference pass per batch; loss and compiled metrics updated."""
        self.broadcast()
        self.test_function = self._per_batch(functools.partial(test_batch, self))
        return self.test_function

    def make_predict_function(self, force: bool = False) -> Any:
        """The towers' inference pass on each batch, outputs concatenated; before
        ``compile`` (``load_model(path, compile=False)``), Keras's own one-device pass."""
        if self.trainer is None:
            return super().make_predict_function(force=True)
        self.broadcast()
        self.predict_function = functools.partial(predict_batches, self.trainer)
        return self.predict_function

    def _per_batch(self, one_batch: Callable[..., dict[str, Any]]) -> Callable[[Any], Any]:
        """A Keras function: ``steps_per_execution`` calls of ``one_batch``."""

        def function(iterator: Any) -> Any:
            unknown = batch_unknown(getattr(iterator, "element_spec", None))
            logs = None
            for _, data in zip(range(self.steps_per_execution), iterator):
                logs = one_batch(data, batch_unknown=unknown) or logs or {}
            if logs is None:  # the data ran out: Keras's catch_stop_iteration ends the epoch
                raise StopIteration
            return logs

        return function

    def _train_batch(self, data: Any, *, batch_unknown: bool = False) -> dict[str, Any]:
        """One towers step on ``data``; the metrics' logs (empty for a batch a resume skips)."""
        if self.resume_skip > 0:
            self.resume_skip -= 1
            return {}
        trainer = self.trainer  # compiled: Keras's fit refuses a model that is not
        assert trainer is not None
        if self.broadcast_pending:  # an epoch's first step: on_epoch_begin's writes land
            self.broadcast_pending = False
            self.broadcast()
        x, y, weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, outputs = trainer.train_step_as_keras(x, y, weight, batch_unknown=batch_unknown)
        return self._update_metrics(x, y, outputs, weight, loss)

    def _update_metrics(self, x: Any, y: Any, outputs: Any, sample_weight: Any,
                       loss: Any) -> dict[str, Any]:  # fmt: skip
        """Feed the loss tracker the batch's mean loss (weight: its size, as MirroredStrategy's
        trackers sum to) and the compiled metrics the outputs; Keras's ``compute_metrics`` logs."""
        self._loss_tracker.update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        if getattr(self, "output_names", None):  # several outputs: "a_loss", "b_loss"
            self._compile_loss(y, outputs, sample_weight)  # Keras's per-output trackers
        logs: dict[str, Any] = self.compute_metrics(x, y, outputs, sample_weight=sample_weight)
        return logs

    # -- writes reach every replica ----------------------------------------------------------

    def reset_metrics(self) -> None:
        """Keras's ``reset_metrics``, then :meth:`broadcast`, and again before the epoch's
        first step (a write in ``on_epoch_begin``, which Keras calls after this, lands)."""
        super().reset_metrics()
        self.broadcast()
        self.broadcast_pending = True

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Set the weights of every replica (``tm.weights`` order), all or nothing."""
        super().set_weights(weights)
        self.broadcast()

    def save_weights(self, filepath: Any, overwrite: bool = True,
                     max_shard_size: Any = None) -> None:  # fmt: skip
        """Keras's ``save_weights`` in :attr:`network`'s own layout (the user's plain model
        loads it), with every optimizer's state (every shard owner's, ``sharded``)."""
        keras.saving.save_weights(AsNetwork(self), filepath, overwrite=overwrite,
                                  max_shard_size=max_shard_size)  # fmt: skip

    def load_weights(self, filepath: Any, skip_mismatch: bool = False, **kwargs: Any) -> None:
        """Keras's ``load_weights`` into :attr:`network` (this model's file or the user's
        plain model's), then to every replica."""
        target = self if str(filepath).endswith(".keras") else AsNetwork(self)
        keras.saving.load_weights(target, filepath, skip_mismatch=skip_mismatch, **kwargs)
        self.broadcast()

    def broadcast(self) -> None:
        """Copy replica 0 to every other replica (:meth:`towers.placement.Replicas.broadcast`)
        and its optimizer's hyperparameters. Nothing to do before ``compile``."""
        if self.trainer is not None:
            self.trainer.follower.follow(self.trainer)
            self.trainer.replicas.broadcast()

    # -- saving ------------------------------------------------------------------------------

    def save(self, filepath: Any, overwrite: bool = True, zipped: Any = None,
             **kwargs: Any) -> None:
        """Keras's ``save`` (a ``.keras`` file that ``keras.models.load_model`` opens).

        Raises:
            ValueError: ``variables="sharded"`` (a ``.keras`` file holds one optimizer).
        """
        if self.trainer is not None and self.trainer.placement.name == "sharded":
            raise ValueError(
                "variables='sharded' cannot be saved as one .keras file (its optimizer state is "
                "sharded over the towers): use tm.save_weights, or towers.training.checkpoint")
        super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def get_config(self) -> dict[str, Any]:
        """The network's config and the towers options; devices as a count
        (:func:`towers.training.export.tower_model_config`)."""
        return tower_model_config(self)

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> TowerModel:
        """A TowerModel on the first ``num_devices`` local devices (all of them if fewer)."""
        return cls(**tower_model_arguments(config, custom_objects))
