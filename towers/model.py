"""``TowerModel``: the Keras face of the step — ``compile``/``fit`` run the towers step.

::

    keras fit/evaluate/predict loop      (data adapters, callbacks, progress bar, History)
          │  one batch from Keras's iterator per step
          ▼
    train_function ─▶ trainer.train_step_as_keras(x, y, w, batch_unknown)  towers/step.py
          │              split → forward_backward → reduce → apply (unchanged)
          ▼
    loss tracker ← the step's global mean loss; compiled metrics ← the step's own outputs

A ``TowerModel`` is a real ``keras.Model`` wrapping the user's model (:attr:`network`,
replica 0's copy). ``compile`` builds the :class:`~towers.TowerTrainer`; the Keras
functions (:mod:`towers.training.keras_functions`) pull one batch at a time and run the
towers' step or inference pass, so everything else is Keras's own.

Writes reach every replica: ``set_weights``/``load_weights`` broadcast replica 0 at once
(:meth:`towers.placement.Replicas.broadcast`), and so does every ``fit``/``evaluate``/
``predict`` and every epoch before its first step, so a callback's direct write lands too;
a callback's change of an optimizer hyperparameter or of ``layer.trainable`` is followed
(:mod:`towers.training.sync`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from towers.devices import canonical_device
from towers.guard.arguments import naming
from towers.guard.given import check_devices
from towers.guard.inputs import check_keras_steps
from towers.guard.options import TowerOptions
from towers.placement import get_placement
from towers.step import TowerTrainer
from towers.training import keras_functions
from towers.training.backup import data_facts
from towers.training.export import AsNetwork
from towers.training.keras_copies import new_model
from towers.training.losses import OutputLosses, is_structured
from towers.training.sync import Hyperparameters

__all__ = ["TowerModel"]

_KERAS_KWARGS = ("trainable", "dtype")
"""``keras.Model`` arguments a config may carry beside the towers options."""


@keras.saving.register_keras_serializable(package="towers")
class TowerModel(keras.Model):
    """A ``keras.Model`` whose ``fit``/``evaluate``/``predict`` run over explicit towers.

    Args:
        model: a built ``keras.Model`` (or a zero-argument factory returning one): the
            network every tower runs. Its variables become replica 0's (it is cloned onto
            replica 0's device when they live elsewhere).
        devices: the towers' devices (default: every local logical device).
        name: the Keras model's name.
        **options: the :class:`~towers.TowerTrainer`'s options
            (:class:`~towers.guard.options.TowerOptions`), each checked here (their
            combination at ``compile``).

    Raises:
        TypeError, ValueError: a wrong model, device list or option (naming it).

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
        self._hyper: Hyperparameters
        self.fit_facts: Any = None  # () -> what ExactResume records and checks, during fit
        self.resume_skip = 0  # batches the train function pulls but does not train
        self.broadcast_pending = False  # broadcast again before the next step (reset_metrics)
        self.built = True

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """The wrapped network on one device (Keras's symbolic build and a plain call)."""
        return self.network(inputs, training=training)

    # -- compile: the trainer ----------------------------------------------------------------

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
        self._hyper = Hyperparameters(first)

    def _replicas(self) -> Any:
        """The network, or (a user's factory: a subclassed model may not clone) a factory
        that hands out the network first and the user's new models after."""
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
        """Keras's ``fit``, recording the data's facts for
        :class:`~towers.training.backup.ExactResume`."""
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

    # -- the Keras functions (towers/training/keras_functions.py) ----------------------------

    def make_train_function(self, force: bool = False) -> Any:
        """One towers step per batch (``steps_per_execution`` batches per call)."""
        self.broadcast()
        self.train_function = keras_functions.train_function(self)
        return self.train_function

    def make_test_function(self, force: bool = False) -> Any:
        """The towers' inference pass per batch; loss and compiled metrics updated."""
        self.broadcast()
        self.test_function = keras_functions.test_function(self)
        return self.test_function

    def make_predict_function(self, force: bool = False) -> Any:
        """The towers' inference pass on each batch, outputs concatenated; before
        ``compile`` (``load_model(path, compile=False)``), Keras's own one-device pass."""
        if self.trainer is None:
            return super().make_predict_function(force=True)
        self.broadcast()
        self.predict_function = keras_functions.predict_function(self)
        return self.predict_function

    # -- writes reach every replica ----------------------------------------------------------

    def reset_metrics(self) -> None:
        """Keras's ``reset_metrics``, then :meth:`broadcast`, and once more before the
        epoch's first step (Keras calls ``on_epoch_begin`` after ``reset_metrics``: a write
        there, SwapEMAWeights swapping back, would otherwise land an epoch later)."""
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
            self._hyper.follow(self.trainer)
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
        """The network's config and the towers options; devices as a count.

        Raises:
            ValueError: ``all_reduce`` is a callable (a name or ``module:NAME`` saves).
        """
        algorithm = self.options.all_reduce
        if algorithm is not None and not isinstance(algorithm, str):
            raise ValueError(
                f"all_reduce={algorithm!r} cannot be saved in a .keras file (its config needs a "
                "registry name or module:NAME); use tm.save_weights (ModelCheckpoint("
                "save_weights_only=True)) or towers.training.checkpoint, or pass the reducer as "
                "module:NAME")
        options = self.options.arguments()
        pd = options["parameter_device"] and canonical_device(options["parameter_device"])
        options["parameter_device"] = self.devices.index(pd) if pd in self.devices else None
        return {
            "name": self.name, "model": keras.saving.serialize_keras_object(self.network),
            "num_devices": len(self.devices), **options,
        }  # fmt: skip

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> TowerModel:
        """A TowerModel on the first ``num_devices`` local devices (all of them if fewer)."""
        config = dict(config)
        network = keras.saving.deserialize_keras_object(config.pop("model"),
                                                        custom_objects=custom_objects)
        local = check_devices(None)
        devices = local[: config.pop("num_devices")]
        pd = config.pop("parameter_device", None)
        return cls(network, devices=devices,
                   parameter_device=None if pd is None or pd >= len(devices) else devices[pd],
                   **config)  # fmt: skip
