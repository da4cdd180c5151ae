"""No step hangs: a collective that never completes becomes ``towers.StepTimeout``.

The hanging algorithm is a user's ``all_reduce_v2`` whose ``group_size`` counts one
tower more than take part, so the collective can never complete. A timed-out
collective aborts every later collective in the process (measured; see
:mod:`towers.guard.deadline`), so the hanging cases run in subprocesses
(``python -m tests.guard.test_deadline CASE`` prints one JSON line) and leave this
test process's collectives working.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import collective_ops

import towers
from tests.conftest import DEVICES
from towers.allreduce.tf_collective_ops import next_key, token
from towers.guard.deadline import Deadline
from towers.testing import OPTIMIZERS, ModelSpec, loss_fn

SPEC = ModelSpec("batchnorm")  # BatchNorm: state that does not wait for the gradients
ROOT = Path(__file__).resolve().parents[2]


def hanging(op_timeout: float) -> Any:
    """A user's algorithm whose collective waits for a tower that never comes."""

    def never_completes(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        group, instance = next_key(), next_key()
        outputs = []
        for v in values:
            with tf.device(v.device):
                outputs.append(collective_ops.all_reduce_v2(
                    v, group_size=len(values) + 1, group_key=group, instance_key=instance,
                    merge_op="Add", final_op="Id", ordering_token=token(v.device),
                    timeout=op_timeout))  # fmt: skip
        return outputs

    return never_completes


def _trainer(algorithm: Any, **kwargs: Any) -> towers.TowerTrainer:
    return towers.TowerTrainer(
        SPEC.build, OPTIMIZERS["adam"], loss_fn(), devices=DEVICES[:3], all_reduce=algorithm,
        variables="replicated", **kwargs,
    )  # fmt: skip


def _state(trainer: towers.TowerTrainer) -> list[bytes]:
    return [
        np.asarray(v.numpy()).tobytes()
        for r in trainer.replicas
        for v in [*r.model.variables, *r.optimizer.variables]
    ]


def _case(op_timeout: float, step_timeout: float | None) -> dict[str, Any]:
    """Run the hanging step, then step again, then train with ``naive`` and ``nccl``."""
    trainer = _trainer(hanging(op_timeout), step_timeout=step_timeout)
    batch = SPEC.batch(6, seed=0)
    trainer.step_function(*batch)  # trace first: the deadline times execution
    before, out = _state(trainer), {}
    for attempt in ("first", "again"):
        start = time.perf_counter()
        try:
            trainer.train_step(*batch)
            out[attempt] = "completed"
        except Exception as err:  # the error's type is what is measured
            out[attempt] = f"{type(err).__module__}.{type(err).__name__}: {err}"
        out[attempt + "_seconds"] = time.perf_counter() - start
    out["unchanged"] = _state(trainer) == before
    for other in ("naive", "nccl"):
        try:
            _trainer(other).train_step(*batch)
            out[other] = "ok"
        except Exception as err:
            out[other] = type(err).__name__
    return out


def _run_cases(*cases: str) -> list[dict[str, Any]]:
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.guard.test_deadline", case], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for case in cases
    ]  # fmt: skip
    results = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=120)  # a hang fails the test, never the suite
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def test_a_collective_that_never_completes_raises_step_timeout_and_changes_nothing() -> None:
    # "op": the user's own op timeout (1 s) fires; "watchdog": the op would wait 10 min,
    # step_timeout=1.5 aborts it.
    op, watchdog = _run_cases("op", "watchdog")
    for result, deadline in ((op, 1.0), (watchdog, 1.5)):
        prefix = "towers.guard.errors.StepTimeout: the step with all-reduce 'never_completes'"
        assert result["first"].startswith(f"{prefix} did not complete")
        assert result["again"].startswith(f"{prefix} failed at once: an earlier step timed out")
        assert "restart the process and resume from a checkpoint" in result["first"]
        assert deadline <= result["first_seconds"] < deadline + 3.0
        assert result["unchanged"]  # weights, slots, iterations, BatchNorm statistics
        # the process's collectives stay aborted: the next step fails at once, as StepTimeout
        assert result["again_seconds"] < 1.0
        assert (result["naive"], result["nccl"]) == ("ok", "StepTimeout")  # copies; collectives
    assert "Collective has timed out waiting for other workers.]" in op["first"]
    assert "within 1.5 s" in watchdog["first"]
    assert "[Collective ops is aborted by: towers: step_timeout=1.5 s passed" in watchdog["first"]


def test_step_timeout_is_bound_into_the_collectives_the_trainer_controls() -> None:
    trainer = _trainer("nccl", step_timeout=30)
    assert trainer.algorithm.timeout_seconds == 30.0
    own = _trainer(towers.allreduce.nccl(timeout_seconds=5), step_timeout=30)
    assert own.algorithm.timeout_seconds == 5  # the user's own op timeout is kept


def test_a_deadline_that_is_not_reached_changes_no_bit() -> None:
    timed, plain = _trainer("nccl", step_timeout=60), _trainer("nccl")
    for k in range(2):
        losses = {float(t.train_step(*SPEC.batch(6, seed=k))).hex() for t in (timed, plain)}
        assert len(losses) == 1
    assert _state(timed) == _state(plain)


@pytest.mark.parametrize("bad", [0, -1, "10", True, float("nan")])
def test_a_bad_step_timeout_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="step_timeout must be None or seconds > 0"):
        Deadline(bad, "naive")


if __name__ == "__main__":
    case = sys.argv[1]
    print(json.dumps(_case(1.0, None) if case == "op" else _case(600.0, 1.5)))
