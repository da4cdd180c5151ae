"""MirroredStrategy reference: one model copy per device, gradients all-reduced.

The reference for towers' ``variables="replicated"`` placement::

    tower 0 ─ fwd/bwd ─┐                      ┌─ apply ─ copy 0
    tower 1 ─ fwd/bwd ─┼── all-reduce (SUM) ──┼─ apply ─ copy 1
      …                │  collective ring or  │   …
    tower n ─ fwd/bwd ─┘  add_n on device 0   └─ apply ─ copy n

Two things make it usable as a test oracle (measured on TF 2.21 / Keras 3.15):

1. *Many strategies in one process.* Every ``MirroredStrategy`` numbers its collective
   groups from 1, so two of them with different models send tensors of different
   shapes under the same (group, instance) keys and the runtime aborts with
   "Shape mismatch in the collective instance 100" — for the rest of the process.
   We build the ``CollectiveAllReduce`` ourselves with ``CollectiveKeys`` whose group
   keys come from a process-wide counter (1_000_000, 1_001_000, …): distinct group
   keys are enough, as instance keys are counted per group.
2. *Non-trainable state drifts.* Keras 3 updates BatchNormalization's moving
   statistics per replica without synchronizing them; reading a variable returns
   replica 0's copy. :meth:`MirroredTrainer.replica_weights` shows every copy.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import cross_device_utils

from reference._loop import LossLike, ModelLike, OptimizerLike, StrategyTrainer, check_devices

__all__ = ["CROSS_DEVICE_OPS", "MirroredTrainer", "collective_all_reduce"]

CROSS_DEVICE_OPS = ("collective", "reduction_to_one_device")

# Towers' own collectives start at 10_000_000; stay below, one block of 1000 per strategy.
_GROUP_KEY_START = 1_000_000
_GROUP_KEY_STRIDE = 1000
_group_keys = itertools.count(_GROUP_KEY_START, _GROUP_KEY_STRIDE)
_group_keys_lock = threading.Lock()


def _next_group_key_start() -> int:
    with _group_keys_lock:
        return next(_group_keys)


def _communication_options(devices: list[str]) -> tf.distribute.experimental.CommunicationOptions:
    """The options MirroredStrategy itself picks: RING on CPUs and virtual GPUs, else AUTO."""
    impl = tf.distribute.experimental.CommunicationImplementation
    physical = tf.config.list_physical_devices("GPU")
    virtual_gpus = len(physical) < len(tf.config.list_logical_devices("GPU"))
    if all("CPU" in d for d in devices) or virtual_gpus:
        return tf.distribute.experimental.CommunicationOptions(implementation=impl.RING)
    return tf.distribute.experimental.CommunicationOptions()


def collective_all_reduce(devices: list[str]) -> tf.distribute.CrossDeviceOps:
    """MirroredStrategy's default ``CollectiveAllReduce``, with process-unique group keys.

    Args:
        devices: canonical device names of the replicas.

    Returns:
        A ``CollectiveAllReduce`` whose collective group keys no other strategy built
        here uses (``CollectiveKeys(group_key_start=...)`` from a process-wide counter).

    Example:
        >>> ops = collective_all_reduce(["/device:CPU:0", "/device:CPU:1"])  # doctest: +SKIP
    """
    keys = cross_device_utils.CollectiveKeys(group_key_start=_next_group_key_start())
    return cross_device_ops_lib.CollectiveAllReduce(
        devices=devices,
        group_size=len(devices),
        options=_communication_options(devices),
        collective_keys=keys,
    )


def _cross_device_ops(choice: Any, devices: list[str]) -> tf.distribute.CrossDeviceOps:
    if isinstance(choice, tf.distribute.CrossDeviceOps):
        return choice
    if choice == "collective":
        return collective_all_reduce(devices)
    if choice == "reduction_to_one_device":
        return tf.distribute.ReductionToOneDevice()
    raise ValueError(
        f"cross_device_ops must be one of {list(CROSS_DEVICE_OPS)} or a "
        f"tf.distribute.CrossDeviceOps instance, got {choice!r}"
    )


class MirroredTrainer(StrategyTrainer):
    """Train with ``tf.distribute.MirroredStrategy`` and a custom loop (towers' reference).

    The same constructor as ``towers.TowerTrainer``; TowerTrainer-only keywords
    (``all_reduce=``, ``variables=``, ``semantics=``, …) are accepted and ignored,
    so a test can pass one set of keyword arguments to both.

    The model and optimizer are created inside ``strategy.scope()`` (a factory is
    called there; a built model is cloned with ``keras.models.clone_model`` and its
    weights copied; an optimizer instance is recreated from its config), and the
    optimizer is built there with ``optimizer.build(model.trainable_variables)``:
    without it, slot optimizers (Adam, Nadam, SGD with momentum) fail in
    ``strategy.run`` with "You must feed a value for placeholder tensor 'cond/...'"
    (keras-team/keras#19246, tensorflow/tensorflow#72686).

    Args:
        model: a built ``keras.Model`` or a zero-argument factory returning one.
        optimizer: a Keras optimizer or a zero-argument factory returning one.
        loss: a ``keras.losses.Loss``, a loss name, or ``(y_true, y_pred) -> per-example``.
        devices: the replicas' device names, e.g. ``DEVICES[:4]``.
        cross_device_ops: ``"collective"`` (MirroredStrategy's default over CPUs: a ring
            ``CollectiveAllReduce``), ``"reduction_to_one_device"`` (add_n on the first
            device: the summation order of towers' ``naive``), or a
            ``tf.distribute.CrossDeviceOps``.
        **_ignored: TowerTrainer-only keywords; ignored.

    Raises:
        TypeError, ValueError: bad devices, model, optimizer, loss or cross_device_ops.

    Example:
        >>> trainer = MirroredTrainer(make_model, keras.optimizers.SGD(0.1), "mse",
        ...                           DEVICES[:4])                    # doctest: +SKIP
        >>> loss = trainer.train_step(x, y)                            # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelLike,
        optimizer: OptimizerLike,
        loss: LossLike,
        devices: list[str],
        *,
        cross_device_ops: str | tf.distribute.CrossDeviceOps = "collective",
        **_ignored: Any,
    ) -> None:
        names = check_devices(devices)
        ops = _cross_device_ops(cross_device_ops, names)
        strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=ops)
        super().__init__(strategy, model, optimizer, loss)

    def replica_weights(self) -> list[list[np.ndarray]]:
        """Every replica's copy of every weight: ``out[replica][i]`` for ``model.weights[i]``.

        ``get_weights`` returns replica 0's copies; this exposes the others, which
        differ for BatchNormalization's moving statistics (see the module docstring).
        """
        n = self.strategy.num_replicas_in_sync
        per_weight = [_copies(v.value, n) for v in self.model.weights]
        return [[copies[replica] for copies in per_weight] for replica in range(n)]


def _copies(variable: Any, n: int) -> list[np.ndarray]:
    if isinstance(variable, tf.distribute.DistributedValues):
        return [np.array(c.numpy()) for c in variable.values]
    return [np.array(variable.numpy())] * n
