"""Parameter servers: the model's variables on ``/job:ps`` tasks, versioned, updated as pushed.

Placement: ``round_robin`` (variable i on ps i mod P) or ``size_balanced`` (largest first onto
the least-loaded task). A pull copies every variable to a worker and reads the versions; a
push (refused when too stale) applies Keras ``SGD.update_step``'s arithmetic on each ps
(``w ← w − lr·g``; momentum ``m ← m·μ − g·lr; w ← w + m``), both under one lock.

References: Dean et al., "Large Scale Distributed Deep Networks" (2012); TensorFlow
``ParameterServerStrategy``; Li et al., "Scaling Distributed ML with the Parameter Server".
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.cluster.runtime import connect
from towers.cluster.spec import Cluster
from towers.guard.arguments import check_choice, positive_float
from towers.guard.errors import TowersError

__all__ = ["POLICIES", "FairLock", "ParameterServerLost", "ParameterStore", "check_rule",
           "connect_ps", "shard_variables"]

POLICIES = ("round_robin", "size_balanced")


class ParameterServerLost(TowersError, ConnectionError):
    """A parameter server did not answer: its task died or the network to it failed."""


def shard_variables(variables: Sequence[Any], ps_devices: Sequence[str],
                    policy: str = "round_robin") -> list[str]:
    """``placement[i]``: the ps device of variable i (variables, arrays or shapes), as drawn.

    Example:
        >>> shard_variables([(4, 3), (3,), (3, 2), (2,)], ["ps0", "ps1"], "size_balanced")
        ['ps0', 'ps1', 'ps1', 'ps1']
    """
    if isinstance(ps_devices, str) or not ps_devices:
        raise ValueError(f"ps_devices must be a non-empty list of devices, got {ps_devices!r}")
    check_choice("policy", policy, POLICIES)
    sizes = []
    for i, v in enumerate(variables):
        try:
            dims = [int(d) for d in getattr(v, "shape", v)]
        except (TypeError, ValueError):
            raise ValueError(
                f"variables[{i}] must have a fully known shape (a variable, an array or a "
                f"tuple of ints), got {v!r}") from None
        if any(d < 0 for d in dims):
            raise ValueError(f"variables[{i}] has a negative dimension: {dims}")
        sizes.append(int(np.prod(dims, dtype=np.int64)))
    if policy == "round_robin":
        return [ps_devices[i % len(ps_devices)] for i in range(len(sizes))]
    load, placement = [0] * len(ps_devices), [""] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        task = min(range(len(ps_devices)), key=lambda k: (load[k], k))
        placement[i] = ps_devices[task]
        load[task] += sizes[i]
    return placement


class FairLock:
    """A first-come, first-served lock (``threading.Lock`` lets one worker win again)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self) -> FairLock:
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            while ticket != self._serving:
                self._cond.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class ParameterStore:
    """The variables on the ps tasks, a version counter per task and the SGD rule (Keras'
    non-Nesterov momentum); a pull or push over ``timeout`` s is ``ParameterServerLost``."""

    def __init__(self, weights: Sequence[np.ndarray], ps_devices: Sequence[str], *,
                 learning_rate: float, momentum: float = 0.0, policy: str = "round_robin",
                 timeout: float = 30.0) -> None:
        check_rule(learning_rate, momentum, timeout)
        self.ps_devices = list(ps_devices)
        self.placement = shard_variables(weights, self.ps_devices, policy)
        self.learning_rate, self.momentum, self.timeout = learning_rate, float(momentum), timeout
        self.variables, self.momentums = [], []
        for w, device in zip(weights, self.placement):
            with tf.device(device):
                self.variables.append(tf.Variable(np.asarray(w, np.float32)))
                if self.momentum:
                    self.momentums.append(tf.Variable(np.zeros_like(w, np.float32)))
        self.versions, self.updates, self.lock = {d: 0 for d in self.ps_devices}, 0, FairLock()
        self._apply = tf.function(self._apply_step, autograph=False)

    def _apply_step(self, grads: Sequence[tf.Tensor]) -> None:
        lr = tf.constant(self.learning_rate, tf.float32)
        mu = tf.constant(self.momentum, tf.float32)
        for i, (var, g) in enumerate(zip(self.variables, grads)):
            with tf.device(self.placement[i]):
                g = tf.identity(g)  # the push: the gradient crosses to this ps task
                if self.momentum:
                    m = self.momentums[i]
                    m.assign(m * mu - g * lr)
                    var.assign_add(m)
                else:
                    var.assign_sub(g * lr)

    def reader(self, targets: Sequence[tf.Variable]) -> Callable[[], dict[str, int]]:
        """A pull into ``targets`` that returns the versions it read."""
        if len(targets) != len(self.variables):
            raise ValueError(f"targets must hold {len(self.variables)} variables, "
                             f"got {len(targets)}")

        @tf.function(autograph=False)
        def copy() -> None:
            for target, var in zip(targets, self.variables):
                with tf.device(str(getattr(target, "value", target).device)):
                    target.assign(var)

        def pull() -> dict[str, int]:
            with self.lock:
                self._guarded(copy, "pull")
                return dict(self.versions)

        return pull

    def push(self, grads: Sequence[tf.Tensor], read: dict[str, int],
             max_staleness: int | None = None,
             record: Callable[[int], None] | None = None) -> int | None:
        """Apply ``grads`` read at versions ``read``; return the new version, or None when
        the read is over ``max_staleness`` old. ``record(version)`` runs under the lock."""
        with self.lock:
            if max_staleness is not None and self.updates - max(read.values()) > max_staleness:
                return None
            self._guarded(lambda: self._apply(list(grads)), "push")
            self.updates += 1
            for device in set(self.placement):
                self.versions[device] += 1
            if record is not None:
                record(self.updates)
            return self.updates

    def get_weights(self) -> list[np.ndarray]:
        """The current weights (numpy, model order)."""
        with self.lock:
            return self._guarded(lambda: [v.numpy() for v in self.variables], "read")

    def _guarded(self, fn: Callable[[], Any], what: str) -> Any:
        pool = concurrent.futures.ThreadPoolExecutor(1)
        future = pool.submit(fn)
        pool.shutdown(wait=False)
        where = f"the {what} on the parameter servers {self.ps_devices}"
        again = "Restart the cluster and resume from the last saved weights."
        try:
            return future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            raise ParameterServerLost(
                f"{where} did not complete within timeout={self.timeout:g} s: a ps task is "
                f"gone or unreachable. {again}") from None
        except (tf.errors.UnavailableError, tf.errors.CancelledError,
                tf.errors.AbortedError, tf.errors.InternalError) as err:
            raise ParameterServerLost(
                f"{where} failed: a ps task is gone or unreachable ({type(err).__name__}: "
                f"{str(err).splitlines()[0]}). {again}") from err


def check_rule(learning_rate: Any, momentum: Any, timeout: Any) -> None:
    positive_float("learning_rate", learning_rate)
    positive_float("timeout", timeout)
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
            or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be a float in [0, 1), got {momentum!r}")


def connect_ps(cluster: Cluster, towers_per_worker: int) -> tuple[list[list[str]], list[str]]:
    """Connect this client; return each worker's towers and the ps devices."""
    if "ps" not in cluster.jobs:
        raise ValueError(f"the cluster has no 'ps' job: {sorted(cluster.jobs)}")
    towers = connect(cluster, towers_per_worker)
    workers = [towers[k:k + towers_per_worker]
               for k in range(0, len(towers), towers_per_worker)]
    ps = [f"{cluster.task_name('ps', k)}/device:CPU:0" for k in range(len(cluster.jobs["ps"]))]
    return workers, ps
