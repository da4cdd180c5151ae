"""Asynchronous data-parallel training against parameter servers, every update logged.

One client (this process) drives W workers, one Python thread each, as
``ClusterCoordinator`` does; the variables live on the ps tasks
(:class:`~towers.cluster.ps.ParameterStore`)::

    worker 0 thread:  take batch b ─ pull (v) ─ towers: split, grads, sum in tower order ─ push
    worker 1 thread:      take batch b+1 ─ pull (v) ─ … grads on its own towers … ─ push
                      (pull and push hold the store's lock; the gradients run in parallel)

    log: [UpdateRecord(worker, worker_step, batch, read={ps k: version}, version), …]
         + the gradient each update applied

Each worker is a :class:`towers.TowerTrainer` over its own towers with its one copy of
the weights on its first tower: its public phases ``split → forward_backward → reduce``
(``all_reduce="naive"``: the towers' gradients added in tower order) make the gradient.
``max_staleness=k``: a push whose read is more than k updates old is refused; the
worker re-reads the weights and recomputes the gradient of the same batch (the log
keeps only applied updates and counts the refusals in :attr:`AsyncTrainer.refused`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.cluster.ps import POLICIES, ParameterStore, check_rule
from towers.guard.arguments import check_choice, non_negative_int, optional
from towers.guard.errors import NonFiniteError
from towers.guard.nonfinite import NONFINITE, describe, gather_codes
from towers.step import TowerTrainer

__all__ = ["AsyncTrainer", "UpdateLog", "UpdateRecord"]


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
    """One applied update.

    Attributes:
        worker: which worker pushed it.
        worker_step: that worker's count of applied updates before this one.
        batch: index of the batch it computed its gradient on.
        read: the version of every ps task's shard it read (``{ps device: version}``).
        version: the update's number (1 for the first applied update): the weights after it
            are version ``version``.
        loss: the worker's mean loss on that batch (at the weights it read).
    """

    worker: int
    worker_step: int
    batch: int
    read: dict[str, int]
    version: int
    loss: float


@dataclasses.dataclass
class UpdateLog:
    """Every applied update in order, its gradient, and what the replay needs.

    Attributes:
        records: the updates in the order the parameter servers applied them.
        gradients: ``gradients[u][var]``, the gradient update ``u`` applied (float32).
        learning_rate, momentum: the ps update rule (SGD).
        placement: the ps device of each variable.
    """

    records: list[UpdateRecord]
    gradients: list[list[np.ndarray]]
    learning_rate: float
    momentum: float
    placement: list[str]


class AsyncTrainer:
    """Asynchronous SGD: workers compute gradients on their towers, the ps apply them as pushed.

    Args:
        model: a zero-argument factory returning a built ``keras.Model`` (trainable
            variables only: non-trainable state has no asynchronous meaning here).
        loss: as for :class:`towers.TowerTrainer`.
        workers: ``workers[w]``: the towers (devices) of worker w, e.g. one task's CPUs.
        ps_devices: the parameter servers' devices (``/job:ps/replica:0/task:k/device:CPU:0``).
        learning_rate, momentum: the SGD rule the ps apply.
        policy: variable placement over the ps (:func:`~towers.cluster.ps.shard_variables`).
        max_staleness: refuse pushes whose read is more than this many updates old.
        timeout: seconds one pull or push may take (then ``ParameterServerLost``).
        on_nonfinite: the non-finite guard's modes (:mod:`towers.guard.nonfinite`), per
            push: ``"skip"`` (default: a gradient or loss with a NaN/Inf on any of the
            worker's towers is pushed to no ps; the batch is counted in
            :attr:`skipped_steps` and listed in :attr:`skipped_batches`), ``"raise"``
            (the same, then :class:`~towers.guard.errors.NonFiniteError`; the other
            workers stop) or ``"ignore"`` (push whatever comes: one NaN batch turns
            every ps weight into NaN).

    Raises:
        ValueError: no workers, a model with non-trainable variables, a bad staleness,
            an unknown ``on_nonfinite``.

    Example:
        >>> trainer = AsyncTrainer(make_model, "mse", workers=[w0, w1], ps_devices=[ps0],
        ...                        learning_rate=0.1)                  # doctest: +SKIP
        >>> log = trainer.run(batches)                                 # doctest: +SKIP
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
        optional(non_negative_int, "max_staleness", max_staleness)
        self.max_staleness = max_staleness
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
        guarded = self.on_nonfinite != "ignore"
        self._grads = [tf.function(_gradient_fn(w, guarded), autograph=False)
                       for w in self.workers]
        self._setters = [_setter(w.model.trainable_variables) for w in self.workers]
        self.refused = 0
        self.skipped_batches: list[int] = []
        self._steps = [0] * len(self.workers)
        self._initial = self.store.get_weights()
        self.log = UpdateLog([], [], learning_rate, float(momentum), self.store.placement)

    def initial_weights(self) -> list[np.ndarray]:
        """The weights of version 0 (before any update)."""
        return [np.asarray(w) for w in self._initial]

    def gradient(self, worker: int, x: Any, y: Any) -> tuple[list[np.ndarray], float]:
        """Worker ``worker``'s gradient and loss on ``(x, y)`` at its current weights."""
        grads, loss, _ = self._grads[worker](*self.workers[worker]._inputs(x, y, None)[:2])
        return [g.numpy() for g in grads], float(loss.numpy())

    def set_worker_weights(self, worker: int, weights: Sequence[np.ndarray]) -> None:
        """Overwrite worker ``worker``'s copy of the weights (for recomputing a logged update)."""
        targets = self.workers[worker].model.trainable_variables
        # One function call, as the pull: remote eager assigns are enqueued asynchronously
        # (measured: a gradient function could run before them and read older weights).
        self._setters[worker]([tf.constant(np.asarray(w, np.float32)) for w in weights])
        for var, w in zip(targets, weights):
            if not np.array_equal(var.numpy(), w):
                raise RuntimeError(f"worker {worker}: its weights were not set")

    def run(self, batches: Sequence[tuple[Any, Any]]) -> UpdateLog:
        """Train on every batch once, asynchronously; return the log (also :attr:`log`).

        Batches are handed out in order to whichever worker asks next (one shared queue).

        Raises:
            ParameterServerLost: a ps task stopped answering (the other workers stop too).
        """
        queue = iter(range(len(batches)))
        take, stop = threading.Lock(), threading.Event()
        errors: list[BaseException] = []

        def work(w: int) -> None:
            try:
                while not stop.is_set():
                    with take:
                        b = next(queue, None)
                    if b is None:
                        return
                    self._one_update(w, b, batches[b])
            except BaseException as err:  # re-raised in the caller below
                errors.append(err)
                stop.set()

        threads = [threading.Thread(target=work, args=(w,), daemon=True)
                   for w in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return self.log

    def _one_update(self, w: int, b: int, batch: tuple[Any, Any]) -> None:
        x, y = self.workers[w]._inputs(batch[0], batch[1], None)[:2]
        while True:
            read = self._pulls[w]()
            grads, loss, codes = self._grads[w](x, y)
            if codes is not None and (bad := describe(codes.numpy())):
                self._skip(w, b, bad)
                return
            arrays, value = [g.numpy() for g in grads], float(loss.numpy())
            record = functools.partial(self._record, w, b, read, arrays, value)
            if self.store.push(grads, read, self.max_staleness, record) is not None:
                return
            with self.store.lock:
                self.refused += 1

    @property
    def skipped_steps(self) -> int:
        """How many batches the non-finite guard kept from the ps (``"skip"``/``"raise"``)."""
        return len(self.skipped_batches)

    def _skip(self, w: int, b: int, bad: dict[int, list[str]]) -> None:
        """Count batch ``b`` as skipped (nothing was pushed); raise in ``"raise"`` mode."""
        with self.store.lock:
            self.skipped_batches.append(b)
            version = self.store.updates
        if self.on_nonfinite == "raise":
            raise NonFiniteError(version, bad, self.workers[w].devices)

    def _record(self, w: int, b: int, read: dict[str, int], arrays: list[np.ndarray],
                value: float, version: int) -> None:
        """Log one applied update (runs under the store's lock: log order = apply order)."""
        self.log.records.append(UpdateRecord(w, self._steps[w], b, read, version, value))
        self.log.gradients.append(arrays)
        self._steps[w] += 1

    def get_weights(self) -> list[np.ndarray]:
        """The parameter servers' current weights."""
        return self.store.get_weights()


def _gradient_fn(trainer: TowerTrainer, guarded: bool) -> Callable[[tf.Tensor, tf.Tensor], Any]:
    """The worker's gradient: its towers' phases, summed in tower order on its first tower,
    its loss and (``guarded``) the guard's per-tower codes, taken before the sum (else None)."""

    def grads(x: tf.Tensor, y: tf.Tensor) -> tuple[list[tf.Tensor], tf.Tensor, Any]:
        towers = trainer.forward_backward(trainer.split(x, y))
        codes = gather_codes(towers.towers, trainer.devices, trainer.parameter_device) \
            if guarded else None
        reduced = trainer.reduce(towers)
        for g in reduced.grads[0]:
            if isinstance(g, tf.IndexedSlices):
                raise ValueError("model: sparse gradients are not supported by the ps update")
        return list(reduced.grads[0]), reduced.loss, codes

    return grads



def _setter(targets: Sequence[Any]) -> Callable[[list[tf.Tensor]], None]:
    """A function that assigns values to ``targets`` (captured, so they stay variables)."""

    @tf.function(autograph=False)
    def assign(values: list[tf.Tensor]) -> None:
        for var, value in zip(targets, values):
            var.assign(value)

    return assign
