"""Nothing waits without a deadline at construction.

The trainer runs a user's all-reduce once at construction (:func:`towers.guard.reduces.
check_sums`). One that never completes — a collective whose group a tower never joins,
a ``GradientReducer`` built on one, a wait on a queue nobody fills — fails
``TowerTrainer(...)`` with a ``TimeoutError`` naming ``all_reduce`` and the seconds,
after ``step_timeout`` when set, else :data:`~towers.guard.reduces.CHECK_TIMEOUT`.
A hang's expiry aborts the process's collectives, so every hanging case runs in its own
subprocess (``python -m tests.guard.test_construction_deadline CASE BOUND``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from tests.conftest import DEVICES
from towers.guard.deadline import within

ROOT = Path(__file__).resolve().parents[2]
NO_HANG = 60.0  # seconds past the bound within which the error must surface (loaded box)


def _collective(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A user's all-reduce over a group of n + 1 on n devices: it never completes."""
    from towers.allreduce.machinery.tf_collective_ops import next_key, token

    group, instance = next_key(), next_key()
    out = []
    for v in values:
        with tf.device(v.device):
            out.append(collective_ops.all_reduce_v2(
                v, group_size=len(values) + 1, group_key=group, instance_key=instance,
                merge_op="Add", final_op="Id", ordering_token=token(v.device)))  # fmt: skip
    return out


_QUEUES: dict[str, Any] = {}


def _queue(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A user's all-reduce that waits on a queue nobody fills (not a collective)."""
    with tf.init_scope():  # made eagerly, outside the traced function
        q = _QUEUES.setdefault("q", tf.queue.FIFOQueue(1, [tf.float32], shapes=[[]]))
    wait = tf.cast(q.dequeue(), values[0].dtype)
    out = []
    for v in values:
        with tf.device(v.device):
            out.append(tf.add_n(list(values)) + wait)
    return out


class _HangingReducer:
    """A ``GradientReducer`` whose reduction is :func:`_collective`, gradient by gradient."""

    def build(self, variables: Any, devices: Any) -> None:
        pass

    def reduce_gradients(self, grads: Any) -> list[list[tf.Tensor]]:
        per_var = [_collective([g[j] for g in grads]) for j in range(len(grads[0]))]
        return [[per_var[j][t] for j in range(len(per_var))] for t in range(len(grads))]


ALGORITHMS = {"collective": _collective, "queue": _queue, "reducer": _HangingReducer}


def _construct(kind: str, bound: str) -> dict[str, Any]:
    import keras

    import towers
    from towers.guard import reduces

    step_timeout = None
    if bound == "default":
        reduces.CHECK_TIMEOUT = 4.0  # the module constant, made short for the test
    else:
        step_timeout = float(bound)
    algorithm = ALGORITHMS[kind]
    algorithm = algorithm() if isinstance(algorithm, type) else algorithm
    start = time.perf_counter()
    try:
        towers.TowerTrainer(lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                            lambda: keras.optimizers.SGD(0.1), "mse", devices=DEVICES[:2],
                            all_reduce=algorithm, step_timeout=step_timeout)  # fmt: skip
        error = "constructed"
    except Exception as err:  # the type and message are what is measured
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "seconds": time.perf_counter() - start}


CASES = [("collective", "5"), ("collective", "default"), ("queue", "3"), ("reducer", "default")]


@pytest.mark.long
def test_a_user_all_reduce_that_never_completes_fails_construction_in_time() -> None:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.guard.test_construction_deadline",
                               kind, bound], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
             for kind, bound in CASES]  # fmt: skip
    for (kind, bound), proc in zip(CASES, procs):
        stdout, _ = proc.communicate(timeout=600)  # a hang fails the test, never the suite
        got = json.loads(stdout.strip().splitlines()[-1])
        seconds = 4.0 if bound == "default" else float(bound)
        assert got["error"].startswith("TimeoutError: all_reduce: "), (kind, bound, got)
        assert f"within {seconds:g} s" in got["error"], (kind, bound, got)
        assert seconds <= got["seconds"] < seconds + NO_HANG, (kind, bound, got)


def test_within_returns_the_result_and_raises_the_error_in_time() -> None:
    assert within(30.0, lambda: 41 + 1, "unused") == 42

    def fails() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        within(30.0, fails, "unused")


def test_a_user_all_reduce_that_completes_is_checked_as_before() -> None:
    import keras

    import towers

    def wrong(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        return [tf.identity(v) for v in values]  # each tower's own: not a sum

    with pytest.raises(towers.AlgorithmError):
        towers.TowerTrainer(lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                            lambda: keras.optimizers.SGD(0.1), "mse", devices=DEVICES[:2],
                            all_reduce=wrong, step_timeout=5)  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(_construct(sys.argv[1], sys.argv[2])), flush=True)
    os._exit(0)  # a thread left waiting on a queue must not hold the process
