"""Asynchronous data-parallel training against parameter servers, every update logged.

One client drives W workers, one thread each (as ``ClusterCoordinator``): take a batch,
pull, gradients on the worker's towers (a ``TowerTrainer``), push. The log holds every
update in apply order with its gradient; :func:`replay` redoes it bitwise in float32 NumPy
(which rounds as TF's CPU kernels: no fused multiply-add).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.cluster.ps import POLICIES, ParameterStore, check_rule
from towers.guard.arguments import check_choice, non_negative_int, optional
from towers.guard.errors import NonFiniteError
from towers.guard.nonfinite import NONFINITE, describe, gather_codes
from towers.split import batch_tensors
from towers.step import TowerTrainer

__all__ = ["AsyncTrainer", "UpdateLog", "UpdateRecord", "load_log", "replay", "replay_versions",
           "save_log"]


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
    """One applied update: worker, its step, batch, versions read, own version, loss."""

    worker: int
    worker_step: int
    batch: int
    read: dict[str, int]
    version: int
    loss: float


@dataclasses.dataclass
class UpdateLog:
    """All the replay needs: the updates in apply order, ``gradients[u][var]``, the rule."""

    records: list[UpdateRecord]
    gradients: list[list[np.ndarray]]
    learning_rate: float
    momentum: float
    placement: list[str]


class AsyncTrainer:
    """Asynchronous SGD: workers compute gradients on their towers, the ps apply them as pushed.

    Args:
        model: a zero-argument factory of a built ``keras.Model`` (trainable variables only).
        workers: ``workers[w]``: the towers (devices) of worker w.
        ps_devices: the parameter servers' devices; ``policy`` places the variables on them.
        max_staleness: refuse pushes read more than this many updates ago (:attr:`refused`).
        timeout: seconds one pull or push may take (then ``ParameterServerLost``).
        on_nonfinite: ``"skip"`` (:attr:`skipped_batches`), ``"raise"`` or ``"ignore"``.
    """

    def __init__(self, model: Callable[[], keras.Model], loss: Any, *,
                 workers: Sequence[Sequence[str]], ps_devices: Sequence[str],
                 learning_rate: float, momentum: float = 0.0, policy: str = "round_robin",
                 max_staleness: int | None = None, timeout: float = 30.0,
                 on_nonfinite: str = "skip") -> None:
        self.on_nonfinite = check_choice("on_nonfinite", on_nonfinite, NONFINITE)
        check_rule(learning_rate, momentum, timeout)
        check_choice("policy", policy, POLICIES)
        if isinstance(workers, str) or not workers or any(not w for w in workers):
            raise ValueError(f"workers must be a non-empty list of tower lists, got {workers!r}")
        self.max_staleness = optional(non_negative_int, "max_staleness", max_staleness)
        self.workers = [
            TowerTrainer(model, keras.optimizers.SGD(learning_rate), loss, devices=list(towers),
                         all_reduce="naive", variables="parameter_device")
            for towers in workers]
        first = self.workers[0].model
        if first.non_trainable_variables:
            raise ValueError("model: asynchronous training supports trainable variables only; "
                             f"it has {len(first.non_trainable_variables)} non-trainable ones")
        self.store = ParameterStore([v.numpy() for v in first.trainable_variables], ps_devices,
                                    learning_rate=learning_rate, momentum=momentum,
                                    policy=policy, timeout=timeout)
        self._pulls = [self.store.reader(w.model.trainable_variables) for w in self.workers]
        self._grads = [tf.function(_gradient_fn(w, self.on_nonfinite != "ignore"),
                                   autograph=False) for w in self.workers]
        self.refused, self._steps = 0, [0] * len(self.workers)
        self.skipped_batches: list[int] = []
        self._initial = self.store.get_weights()
        self.log = UpdateLog([], [], learning_rate, float(momentum), self.store.placement)

    def initial_weights(self) -> list[np.ndarray]:
        """The weights of version 0."""
        return [np.asarray(w) for w in self._initial]

    def run(self, batches: Sequence[tuple[Any, Any]]) -> UpdateLog:
        """Train on every batch once, each to the next free worker; return :attr:`log`."""
        queue, lock, stop = iter(range(len(batches))), threading.Lock(), threading.Event()

        def take() -> int | None:
            with lock:
                return None if stop.is_set() else next(queue, None)

        def work(w: int) -> None:
            try:
                while (b := take()) is not None:
                    self._one_update(w, b, batches[b])
            except BaseException:
                stop.set()
                raise

        with concurrent.futures.ThreadPoolExecutor(len(self.workers)) as pool:
            futures = [pool.submit(work, w) for w in range(len(self.workers))]
        for future in futures:
            future.result()
        return self.log

    def _one_update(self, w: int, b: int, batch: tuple[Any, Any]) -> None:
        x, y = batch_tensors(batch[0], batch[1], None, self.workers[w].model)[:2]
        while True:
            read = self._pulls[w]()
            grads, loss, codes = self._grads[w](x, y)
            if codes is not None and (bad := describe(codes.numpy())):
                with self.store.lock:
                    self.skipped_batches.append(b)
                    version = self.store.updates
                if self.on_nonfinite == "raise":
                    raise NonFiniteError(version, bad, self.workers[w].devices)
                return
            arrays, value = [g.numpy() for g in grads], float(loss.numpy())
            record = functools.partial(self._record, w, b, read, arrays, value)
            if self.store.push(grads, read, self.max_staleness, record) is not None:
                return
            with self.store.lock:
                self.refused += 1

    @property
    def skipped_steps(self) -> int:
        """How many batches the non-finite guard kept from the ps."""
        return len(self.skipped_batches)

    def _record(self, w: int, b: int, read: dict[str, int], arrays: list[np.ndarray],
                value: float, version: int) -> None:
        self.log.records.append(UpdateRecord(w, self._steps[w], b, read, version, value))
        self.log.gradients.append(arrays)
        self._steps[w] += 1

    def get_weights(self) -> list[np.ndarray]:
        """The parameter servers' current weights."""
        return self.store.get_weights()


def _gradient_fn(trainer: TowerTrainer, guarded: bool) -> Callable[[tf.Tensor, tf.Tensor], Any]:

    def grads(x: tf.Tensor, y: tf.Tensor) -> tuple[list[tf.Tensor], tf.Tensor, Any]:
        towers = trainer.forward_backward(trainer.split(x, y))
        codes = gather_codes(towers.towers, trainer.devices, trainer.parameter_device) \
            if guarded else None
        reduced = trainer.reduce(towers)
        if any(isinstance(g, tf.IndexedSlices) for g in reduced.grads[0]):
            raise ValueError("model: sparse gradients are not supported by the ps update")
        return list(reduced.grads[0]), reduced.loss, codes

    return grads


def save_log(log: UpdateLog, prefix: str | Path) -> tuple[Path, Path]:
    """Write ``PREFIX.json`` (records, rule) and ``PREFIX.npz`` (gradients); return both."""
    prefix = Path(prefix)
    meta = {"learning_rate": log.learning_rate, "momentum": log.momentum,
            "placement": log.placement, "records": [vars(r) for r in log.records]}
    json_path, npz_path = prefix.with_suffix(".json"), prefix.with_suffix(".npz")
    json_path.write_text(json.dumps(meta, indent=1))
    arrays = {f"u{u}_v{i}": g for u, grads in enumerate(log.gradients) for i, g in enumerate(grads)}
    np.savez(npz_path, **arrays)  # type: ignore[arg-type]
    return json_path, npz_path


def load_log(prefix: str | Path) -> UpdateLog:
    """Read a log written by :func:`save_log` (``ValueError``: a gradient is missing)."""
    prefix = Path(prefix)
    meta = json.loads(prefix.with_suffix(".json").read_text())
    records = [UpdateRecord(**r) for r in meta["records"]]
    n = len(meta["placement"])
    with np.load(prefix.with_suffix(".npz")) as data:
        missing = [f"u{u}_v{i}" for u in range(len(records)) for i in range(n)
                   if f"u{u}_v{i}" not in data.files]
        if missing:
            raise ValueError(f"log {prefix}: the .npz lacks gradients {missing[:5]}")
        gradients = [[data[f"u{u}_v{i}"] for i in range(n)] for u in range(len(records))]
    return UpdateLog(records, gradients, meta["learning_rate"], meta["momentum"],
                     meta["placement"])


def replay_versions(log: UpdateLog,
                    initial_weights: Sequence[np.ndarray]) -> Iterator[list[np.ndarray]]:
    """Yield the weights of version 0, 1, …, len(log.records) (float32 NumPy)."""
    lr, mu = np.float32(log.learning_rate), np.float32(log.momentum)
    weights = [np.array(w, np.float32) for w in initial_weights]
    moments = [np.zeros_like(w) for w in weights]
    yield [w.copy() for w in weights]
    for u, (record, grads) in enumerate(zip(log.records, log.gradients)):
        if record.version != u + 1:
            raise ValueError(f"log: update {u} has version {record.version}, expected {u + 1}")
        if [g.shape for g in grads] != [w.shape for w in weights]:
            raise ValueError(f"log: update {u}'s gradient shapes {[g.shape for g in grads]} "
                             f"do not match the weights' {[w.shape for w in weights]}")
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float32)
            if log.momentum:
                moments[i] = moments[i] * mu - g * lr
                weights[i] = weights[i] + moments[i]
            else:
                weights[i] = weights[i] - g * lr
        yield [w.copy() for w in weights]


def replay(log: UpdateLog, initial_weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The final weights, bitwise as the ps applied them, from ``initial_weights()``."""
    *_, last = replay_versions(log, initial_weights)
    return last
