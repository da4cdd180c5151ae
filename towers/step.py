"""``TowerTrainer``: one synchronous data-parallel step over explicit towers.

::

    batch ─split─▶ shard_0 … shard_{n-1}        (MirroredStrategy's split)
                     │ tower i: tf.device(d_i), GradientTape, loss / B_global
                     ▼
                grads[tower][var] ─▶ all-reduce per variable ─▶ reduced[tower][var]
                     │
    parameter_device: apply once on the parameter device (one copy of each variable)
    replicated:       every tower applies the same update to its own copy

Non-trainable state (BatchNormalization's moving statistics) is combined
explicitly, because Keras 3 under MirroredStrategy lets each replica's copy drift
(DESIGN.md): ``non_trainable="mean"`` (default) averages the towers' updates over
the towers that saw examples, so every copy stays identical; ``"first_tower"``
keeps tower 0's update, reproducing what MirroredStrategy shows when read.
Integer state (dropout seed counters) advances identically on every tower; tower
0's value is kept.

Everything happens in one ``tf.function``, traced once per input signature and run
:func:`towers.allreduce.ordering.as_written`, so additions happen in the order the code states.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers import allreduce
from towers.allreduce.base import GradientReducer
from towers.allreduce.naive import naive
from towers.allreduce.ordering import as_written
from towers.allreduce.parameter_device import parameter_device as _parameter_device_algo
from towers.allreduce.parameter_device import reduce_on
from towers.allreduce.primitives import Recorder, Transfer, record, send
from towers.devices import canonical_device, local_devices
from towers.placement import ModelLike, OptimizerLike, Replica, make_replicas, variable_values
from towers.split import shard_sizes, split
from towers.tower import LossFn, TowerResult, empty_tower_step, resolve_loss, tower_step

__all__ = ["NON_TRAINABLE", "PLACEMENTS", "StepStats", "TowerTrainer"]

PLACEMENTS = ("parameter_device", "replicated")
NON_TRAINABLE = ("mean", "first_tower")


def check_devices(devices: Sequence[str] | None) -> list[str]:
    """Validate tower devices and return their canonical names.

    Raises:
        ValueError: no devices, duplicates, or a name TensorFlow does not know.
        TypeError: not a list of strings.
    """
    if devices is None:
        devices = local_devices()
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list of device names, got {devices!r}")
    if not devices:
        raise ValueError("devices is empty: give at least one device (see towers.simulate_devices)")
    known = {canonical_device(d.name) for d in tf.config.list_logical_devices()}
    out: list[str] = []
    for d in devices:
        if not isinstance(d, str):
            raise TypeError(f"devices must hold strings, got {d!r}")
        c = canonical_device(d)
        if c not in known:
            raise ValueError(f"devices: unknown device {d!r}; known: {', '.join(sorted(known))}")
        if c in out:
            raise ValueError(f"devices: {d!r} appears twice; each tower needs its own device")
        out.append(c)
    return out


def _check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _leading_dims(name: str, structure: Any) -> set[int]:
    """Static leading dimensions of every tensor in ``structure`` (unknown ones skipped)."""
    dims = set()
    for t in tf.nest.flatten(structure):
        shape = tf.TensorShape(getattr(t, "shape", np.shape(t)))
        if shape.rank == 0:
            raise ValueError(f"{name} has a scalar where a batch was expected")
        if shape.rank is not None and shape[0] is not None:
            dims.add(int(shape[0]))
    return dims


def _check_batch(x: Any, y: Any, sample_weight: Any) -> None:
    parts = {"x": x, "y": y, "sample_weight": sample_weight}
    dims = {k: _leading_dims(k, v) for k, v in parts.items() if v is not None}
    all_sizes = set().union(*dims.values())
    if len(all_sizes) > 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in dims.items())
        raise ValueError(f"x, y and sample_weight must share their batch size; got {detail}")
    if all_sizes == {0}:
        raise ValueError("the batch is empty: x has 0 examples")


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one training step sends: per tower, per directed link, and how many ticks."""

    bytes_per_tower: dict[str, int]
    bytes_per_link: dict[tuple[str, str], int]
    ticks: int
    estimated: bool
    transfers: tuple[Transfer, ...]

    @classmethod
    def from_recorder(cls, recorder: Recorder) -> StepStats:
        return cls(
            bytes_per_tower=recorder.bytes_sent(),
            bytes_per_link=recorder.bytes_per_link(),
            ticks=recorder.ticks(),
            estimated=any(t.estimated for t in recorder.transfers),
            transfers=tuple(recorder.transfers),
        )


class TowerTrainer:
    """Data-parallel training over explicit towers with a hand-built all-reduce.

    Args:
        model: a built ``keras.Model`` or a zero-argument factory returning one.
        optimizer: a Keras optimizer or a zero-argument factory.
        loss: a Keras loss, a loss name, or ``(y_true, y_pred) -> per-example losses``.
        devices: the towers' devices (default: every local logical device).
        all_reduce: a name from ``towers.ALGORITHMS`` or an algorithm callable.
        variables: ``"parameter_device"`` (one copy, updated on the parameter device;
            CentralStorageStrategy's layout) or ``"replicated"`` (one copy per tower,
            all updated identically; MirroredStrategy's layout).
        parameter_device: where the single copy lives (default: the first tower).
        non_trainable: ``"mean"`` or ``"first_tower"`` (see the module docstring).
        sparse: ``"gather"`` (keep ``IndexedSlices``, concatenated in tower order, as
            MirroredStrategy does) or ``"densify"`` (dense all-reduce of sparse gradients).

    Example:
        >>> devices = towers.simulate_devices(4)                      # doctest: +SKIP
        >>> trainer = towers.TowerTrainer(make_model, keras.optimizers.SGD(0.1),
        ...     "sparse_categorical_crossentropy", devices=devices, all_reduce="naive")
        >>> loss = trainer.train_step(x, y)                            # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: OptimizerLike,
        loss: str | LossFn | keras.losses.Loss,
        devices: Sequence[str] | None = None,
        all_reduce: str | allreduce.AllReduce | GradientReducer = "parameter_device",
        variables: str = "parameter_device",
        parameter_device: str | None = None,
        non_trainable: str = "mean",
        sparse: str = "gather",
    ) -> None:
        self.devices = check_devices(devices)
        self.placement = _check_choice("variables", variables, PLACEMENTS)
        self.non_trainable_mode = _check_choice("non_trainable", non_trainable, NON_TRAINABLE)
        self.sparse = _check_choice("sparse", sparse, ("gather", "densify"))
        self.parameter_device = (
            check_devices([parameter_device])[0] if parameter_device else self.devices[0]
        )
        self.loss_fn = resolve_loss(loss)
        if all_reduce == "parameter_device":
            self.algorithm: Any = _parameter_device_algo(self.parameter_device)
        elif isinstance(all_reduce, GradientReducer):
            self.algorithm = all_reduce
        else:
            self.algorithm = allreduce.get(all_reduce)
        # Sparse gradients (and every gradient, for a per-tensor algorithm) use this one.
        self._per_tensor: allreduce.AllReduce = (
            self.algorithm if not isinstance(self.algorithm, GradientReducer) else naive
        )
        homes = [self.parameter_device] if self.placement == "parameter_device" else self.devices
        self.replicas: list[Replica] = make_replicas(model, optimizer, homes)
        if isinstance(self.algorithm, GradientReducer):
            self.algorithm.build(self.model.trainable_variables, self.devices)
        self.trace_count = 0
        self.last_trace_stats: Recorder | None = None
        # No reduce_retracing: a static batch size gives static shard sizes (empty towers are
        # skipped at trace time); a new batch size costs one more trace, not one per step.
        self._step = tf.function(self._train_step, autograph=False)
        self._step_with_outputs = tf.function(
            functools.partial(self._train_step, with_outputs=True), autograph=False
        )

    @property
    def model(self) -> keras.Model:
        """The trained model (the parameter-device copy, or tower 0's replica)."""
        return self.replicas[0].model

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        """The optimizer of :attr:`model`."""
        return self.replicas[0].optimizer

    # -- public API ---------------------------------------------------------------------------

    def train_step(
        self, x: Any, y: Any, sample_weight: Any = None, *, return_outputs: bool = False
    ) -> Any:
        """Run one synchronous step on a global batch and return the global mean loss.

        With ``return_outputs=True`` it returns ``(loss, outputs)``: the model's outputs
        of this very step (training mode), concatenated in tower order — what training
        metrics should see.

        Raises:
            ValueError: x, y and sample_weight disagree on the batch size, or it is 0.
        """
        _check_batch(x, y, sample_weight)
        x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
        if sample_weight is not None:
            sample_weight = tf.convert_to_tensor(sample_weight, dtype=self._float_dtype())
        step = self._step_with_outputs if return_outputs else self._step
        with as_written():
            return step(x, y, sample_weight)

    @property
    def last_step_stats(self) -> StepStats | None:
        """Communication of one step (bytes per tower and per link, ticks), or None before
        the first step. Counted at :func:`~towers.allreduce.send` when the step was traced;
        traffic of opaque collectives is estimated and flagged."""
        if self.last_trace_stats is None:
            return None
        return StepStats.from_recorder(self.last_trace_stats)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """Keras-style training loop; see :func:`towers.training.fit.fit`."""
        from towers.training.fit import fit

        return fit(self, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Loss and metrics over a dataset, split over towers; see ``training.fit.evaluate``."""
        from towers.training.fit import evaluate

        return evaluate(self, *args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Model outputs, split over towers; see :func:`towers.training.fit.predict`."""
        from towers.training.fit import predict

        return predict(self, *args, **kwargs)

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights as NumPy arrays, in ``model.weights`` order."""
        return variable_values(self.model.weights)

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Set every replica's weights (``model.weights`` order)."""
        for replica in self.replicas:
            replica.model.set_weights(list(weights))

    def replica_weights(self) -> list[list[np.ndarray]]:
        """Every replica's weights (one list per replica; a single one for parameter_device)."""
        return [variable_values(r.model.weights) for r in self.replicas]

    # -- the step -----------------------------------------------------------------------------

    def _float_dtype(self) -> tf.DType:
        return tf.as_dtype(self.model.trainable_variables[0].dtype)

    def _replica_of(self, tower: int) -> Replica:
        return self.replicas[0] if len(self.replicas) == 1 else self.replicas[tower]

    def _tower_values(self, tower: int) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """Read the variables a tower uses and move them onto the tower's device."""
        replica = self._replica_of(tower)
        dst = self.devices[tower]
        with tf.device(replica.device):
            trainable = [tf.convert_to_tensor(v.value) for v in replica.model.trainable_variables]
            frozen = [tf.convert_to_tensor(v.value) for v in replica.model.non_trainable_variables]
        src = replica.device
        return (
            [send(t, dst, src=src, note="read-weights") for t in trainable],
            [send(t, dst, src=src, note="read-weights") for t in frozen],
        )

    def _train_step(self, x: Any, y: Any, sample_weight: Any, with_outputs: bool = False) -> Any:
        self.trace_count += 1
        with record() as recorder:
            loss, results = self._step_body(x, y, sample_weight)
            if with_outputs:
                with tf.device(self.parameter_device):
                    parts = [r.outputs for r in results]
                    outputs = tf.nest.map_structure(lambda *t: tf.concat(t, 0), *parts)
        self.last_trace_stats = recorder
        return (loss, outputs) if with_outputs else loss

    def _shards(self, x: Any, y: Any, sample_weight: Any) -> tuple[list[Any], list[int | None]]:
        """Split the batch; with a static batch size, shard sizes are known at trace time."""
        n = len(self.devices)
        batch = (x, y, sample_weight) if sample_weight is not None else (x, y)
        static = tf.nest.flatten(x)[0].shape[0]
        if static is None:
            shards = split(batch, n)
            sizes: list[int | None] = [None] * n
        else:
            sizes = list(shard_sizes(int(static), n))
            bounds = np.cumsum([0, *sizes])
            shards = [
                tf.nest.map_structure(lambda t, a=a, b=b: t[a:b], batch)
                for a, b in itertools.pairwise(bounds)
            ]
        if sample_weight is None:
            shards = [(*s, None) for s in shards]
        return shards, sizes

    def _step_body(self, x: Any, y: Any, sample_weight: Any) -> tuple[tf.Tensor, list[TowerResult]]:
        n = len(self.devices)
        shards, sizes = self._shards(x, y, sample_weight)
        global_batch = tf.shape(tf.nest.flatten(x)[0])[0]
        results: dict[int, TowerResult] = {}
        for i, device in enumerate(self.devices):
            if sizes[i] == 0:
                continue
            trainable, frozen = self._tower_values(i)
            results[i] = tower_step(
                self.model,
                trainable,
                frozen,
                shards[i],
                loss_fn=self.loss_fn,
                global_batch=global_batch,
                num_towers=n,
                device=device,
            )
        template = results[0]  # tower 0 always has examples: the batch is not empty
        ordered = [
            results[i] if i in results else self._empty_tower(i, template, n) for i in range(n)
        ]
        self._finish_step(ordered)
        with tf.device(self.parameter_device):
            losses = [send(r.loss, self.parameter_device, note="loss") for r in ordered]
            return tf.add_n(losses), ordered

    def _empty_tower(self, tower: int, template: TowerResult, n: int) -> TowerResult:
        trainable, frozen = self._tower_values(tower)
        return empty_tower_step(
            self.model,
            trainable,
            frozen,
            template=template,
            num_towers=n,
            device=self.devices[tower],
        )

    def _finish_step(self, results: list[TowerResult]) -> None:
        """All-reduce the gradients, combine the state and apply the update."""
        reduced = self._reduce_gradients([r.grads for r in results])
        new_state = self._combine_non_trainable(results)
        self._apply(reduced, new_state)

    def _reduce_gradients(self, grads: list[list[Any]]) -> list[list[Any]]:
        """``grads[tower][var]`` -> ``reduced[replica][var]`` through the all-reduce.

        Sparse gradients are gathered in tower order (or densified, see ``sparse=``);
        dense ones go to the algorithm one variable at a time, or all at once when the
        algorithm is a :class:`~towers.allreduce.base.GradientReducer`.
        """
        n_vars = len(grads[0])
        per_tower: list[list[Any]] = [[None] * n_vars for _ in self.devices]
        dense = [j for j in range(n_vars) if not isinstance(grads[0][j], tf.IndexedSlices)]
        if isinstance(self.algorithm, GradientReducer) and dense:
            outs = self.algorithm.reduce_gradients([[g[j] for j in dense] for g in grads])
            for i, row in enumerate(outs):
                for j, out in zip(dense, row):
                    per_tower[i][j] = out
        for j in range(n_vars):
            if per_tower[0][j] is not None:
                continue
            values = [g[j] for g in grads]
            outs = allreduce.all_reduce(values, self._per_tensor, op="sum", sparse=self.sparse)
            for i, out in enumerate(outs):
                per_tower[i][j] = out
        if self.placement == "parameter_device":
            # Outputs are identical; the unused copies are pruned from the graph.
            return [per_tower[0]]
        return per_tower

    def _combine_non_trainable(self, results: list[TowerResult]) -> list[tf.Tensor]:
        """One new value per non-trainable variable, formed on the parameter device."""
        p = self.parameter_device
        combined = []
        with tf.device(p):
            counts = [send(r.examples, p, note="state") for r in results]
            for j in range(len(results[0].non_trainable)):
                values = [r.non_trainable[j] for r in results]
                if self.non_trainable_mode == "first_tower" or not values[0].dtype.is_floating:
                    combined.append(send(values[0], p, note="state"))
                    continue
                masked = [
                    tf.where(c > 0, send(v, p, note="state"), tf.zeros_like(v))
                    for v, c in zip(values, counts)
                ]
                seen = tf.add_n([tf.cast(c > 0, values[0].dtype) for c in counts])
                total = reduce_on(masked, p, "sum")
                combined.append(total / seen)
        return combined

    def _apply(self, reduced: list[list[Any]], new_state: list[tf.Tensor]) -> None:
        for replica, grads in zip(self.replicas, reduced):
            with tf.device(replica.device):
                variables = replica.model.trainable_variables
                replica.optimizer.apply_gradients(zip(grads, variables))
                for var, value in zip(replica.model.non_trainable_variables, new_state):
                    var.assign(send(value, replica.device, note="state"))
