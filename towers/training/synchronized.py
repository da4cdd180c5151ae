"""``BatchNormalization(synchronized=True)`` over towers: the global batch's statistics.

Under a ``tf.distribute`` strategy Keras computes a synchronized layer's moments in
``keras.src.backend.tensorflow.nn._compute_moments_sync``: each replica's sums, summed
over the replicas by its replica context's ``all_reduce``. Towers run in no replica
context (there that function falls back to the shard's own moments), so while a
trainer builds its towers' forward and backward passes, :func:`synchronized` replaces
that private function with :meth:`Rendezvous.moments`, the same arithmetic over
TensorFlow's collective ops among the towers that run the model::

    forward_backward: one graph, the towers traced one after another
      tower i, synchronized call k (its k-th BatchNormalization):
        Σx, Σx², count over the shard ─ all_reduce_v2(instance key F_k) ─┐ every tower's
        mean = ΣΣx / Σcount, var = max(ΣΣx² / Σcount − mean², 0)        │ call k meets
      its backward (tf.custom_gradient):                                 │ at run time
        dΣx, dΣx² ─────────────────────── all_reduce_v2(instance key B_k) ┘

The towers' calls meet only when the graph runs, so every tower's k-th call must use
one key: tower 0 draws ``F_k`` (``B_k``) the first time call ``k`` is traced, the others
reuse it. Each device's ordering token runs its collectives in program order. Three
all-reduces, as Keras's (not one concatenated): the same sums in the same order as
MirroredStrategy's collective ring. The gradient of a sum all-reduce is the sum
all-reduce of the upstream gradients, as ``ReplicaContext.all_reduce``'s.

A single tower in the group (one tower, or every other one empty: an empty tower runs
no model and would add zeros) keeps Keras's own local moments. A Keras without that
function is refused when the step is traced, never silently run per tower; a tower
alone, or the towers eagerly, cannot meet and are refused too.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from towers.allreduce.machinery.tf_collective_ops import HINT, group_key, next_key, token

__all__ = ["Rendezvous", "check_not_alone", "synchronized", "synchronized_towers"]

KERAS_MODULE = "keras.src.backend.tensorflow.nn"
KERAS_FUNCTION = "_compute_moments_sync"
"""The private Keras function replaced: ``moments(..., synchronized=True)`` calls it."""
_ACTIVE: list[Rendezvous] = []


def synchronized_towers(trainer: Any, shards: Any, divisor: Any) -> dict[int, Any]:
    """``TowerTrainer.forward_backward``'s towers that run the model, traced within
    :func:`synchronized` over their devices: ``{tower: TowerResult}``.

    Raises:
        ValueError: run eagerly over more than one tower (each op would run, and wait for
            its peers, before the next tower's exist).
    """
    ran = {}
    model_towers = trainer.model_towers(shards)
    if tf.executing_eagerly() and len(model_towers) > 1:  # the first collective would wait
        raise ValueError(f"forward_backward ran eagerly: the BatchNormalization(synchronized="
                         f"True) layers {trainer.synchronized} meet every tower's statistics "
                         "when one graph runs them; call it inside a tf.function")
    with synchronized([trainer.devices[i] for i in model_towers]) as rendezvous:
        for position, i in enumerate(model_towers):
            with rendezvous.tower(position):
                ran[i] = trainer.tower_step(shards, i, divisor=divisor)
    return ran


def check_not_alone(synchronized: Sequence[str]) -> None:
    """Refuse one tower's step alone when the model has ``synchronized`` layers: they meet
    every tower's statistics (within :func:`synchronized_towers` all towers run)."""
    if synchronized and not _ACTIVE:
        raise ValueError(f"tower_step: the model's BatchNormalization(synchronized=True) "
                         f"layers {list(synchronized)} meet every tower's statistics, so one "
                         "tower cannot run alone; call forward_backward (every tower)")


class Rendezvous:
    """The towers' synchronized-moments calls of one trace and the keys they meet by.

    Args:
        devices: the devices of the towers that run the model, in tower order.
        local: Keras's own ``_compute_moments_sync`` (a group of one keeps it).
    """

    def __init__(self, devices: Sequence[str], local: Callable[..., Any]) -> None:
        self.devices = tuple(devices)
        self.local = local
        self.group = group_key(self.devices) if len(self.devices) > 1 else 0
        self.keys: dict[str, list[int]] = {"forward": [], "backward": []}
        self.calls = [0] * len(self.devices)
        self.current: int | None = None

    @contextlib.contextmanager
    def tower(self, position: int) -> Iterator[None]:
        """Trace tower ``devices[position]``'s forward and backward pass."""
        self.current = position
        try:
            yield
        finally:
            self.current = None

    def key(self, direction: str, call: int) -> int:
        """The instance key of every tower's ``call``-th all-reduce in ``direction``."""
        keys = self.keys[direction]
        while len(keys) <= call:
            keys.append(next_key())
        return keys[call]

    def moments(self, x: tf.Tensor, axes: Any, keepdims: bool) -> tuple[tf.Tensor, tf.Tensor]:
        """``_compute_moments_sync``'s arithmetic with the towers' all-reduce."""
        if self.current is None:
            raise RuntimeError("a synchronized BatchNormalization ran outside a tower of "
                               "TowerTrainer.forward_backward: its peers cannot meet it")
        if len(self.devices) == 1:
            return self.local(x, axes, keepdims)  # type: ignore[no-any-return]
        position, call = self.current, self.calls[self.current]
        self.calls[position] += 1
        device = self.devices[position]
        count = tf.reduce_sum(tf.ones_like(x, name="count"), axis=axes, keepdims=True)
        local_sum = tf.reduce_sum(x, axis=axes, keepdims=True)
        local_squared_sum = tf.reduce_sum(tf.square(x), axis=axes, keepdims=True)
        y_sum, y_squared_sum = self._summed(local_sum, local_squared_sum, device, call)
        count_sum = self._all_reduce(count, device, self.key("forward", 3 * call + 2))
        mean = tf.math.divide_no_nan(y_sum, count_sum)
        y_squared_mean = tf.math.divide_no_nan(y_squared_sum, count_sum)
        variance = tf.maximum(y_squared_mean - tf.square(mean), 0.0)
        if not keepdims:
            mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        return mean, variance

    def _summed(self, local_sum: tf.Tensor, local_squared_sum: tf.Tensor, device: str,
                call: int) -> tuple[tf.Tensor, tf.Tensor]:  # fmt: skip
        """Σx and Σx² over the towers, differentiable (the backward sums the upstream)."""

        @tf.custom_gradient
        def summed(a: tf.Tensor, b: tf.Tensor) -> tuple[tuple[tf.Tensor, tf.Tensor], Any]:
            outs = (self._all_reduce(a, device, self.key("forward", 3 * call)),
                    self._all_reduce(b, device, self.key("forward", 3 * call + 1)))

            def backward(da: tf.Tensor | None, db: tf.Tensor | None
                         ) -> tuple[tf.Tensor, tf.Tensor]:  # fmt: skip
                da = tf.zeros_like(a) if da is None else da  # every tower meets, used or not
                db = tf.zeros_like(b) if db is None else db
                return (self._all_reduce(da, device, self.key("backward", 2 * call)),
                        self._all_reduce(db, device, self.key("backward", 2 * call + 1)))

            return outs, backward

        return summed(local_sum, local_squared_sum)  # type: ignore[no-any-return]

    def _all_reduce(self, x: tf.Tensor, device: str, instance: int) -> tf.Tensor:
        with tf.device(device):
            return collective_ops.all_reduce_v2(
                x, len(self.devices), self.group, instance, merge_op="Add", final_op="Id",
                communication_hint=HINT, ordering_token=token(device))

    def check_balanced(self) -> None:
        """Every tower made the same number of synchronized calls (else some would wait
        forever at run time)."""
        if len(set(self.calls)) > 1:
            raise RuntimeError(f"synchronized BatchNormalization: the towers on {self.devices} "
                               f"made {self.calls} synchronized-moments calls; every tower "
                               "must make the same number")


@contextlib.contextmanager
def synchronized(devices: Sequence[str]) -> Iterator[Rendezvous]:
    """Within: Keras's ``_compute_moments_sync`` is :meth:`Rendezvous.moments` of a fresh
    :class:`Rendezvous` over ``devices`` (restored on exit).

    Raises:
        RuntimeError: this Keras has no ``_compute_moments_sync`` (towers cannot honour
            ``synchronized=True`` on it); the towers' calls do not balance.
    """
    module = importlib.import_module(KERAS_MODULE)
    original = getattr(module, KERAS_FUNCTION, None)
    if original is None:
        raise RuntimeError(
            f"BatchNormalization(synchronized=True): this Keras ({keras.__version__}) has no "
            f"{KERAS_MODULE}.{KERAS_FUNCTION}, which towers replaces to all-reduce the "
            "statistics over the towers; use synchronized=False or one tower")
    rendezvous = Rendezvous(devices, original)
    setattr(module, KERAS_FUNCTION, rendezvous.moments)
    _ACTIVE.append(rendezvous)
    try:
        yield rendezvous
    finally:
        _ACTIVE.pop()
        setattr(module, KERAS_FUNCTION, original)
    rendezvous.check_balanced()
