"""The runtime: ``leave_together``'s exit barrier; ``configure_gpus`` checked before
TensorFlow, too late an error, GPUs set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

from towers.cluster import free_ports, leave_together, resolve
from towers.cluster.runtime import RuntimeStartedError, configure_gpus, runtime_started
from towers.guard.errors import TowersError

from ..conftest import GPUS


def _jobs() -> dict[str, list[str]]:
    """Two local workers on ports of their own (the barrier's folder is named after them)."""
    return {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}


def test_a_worker_waits_for_the_others_and_then_leaves() -> None:
    jobs = _jobs()
    first = resolve(jobs, "worker", 0)
    # alone, worker 0 waits out its limit and says the peer never came
    assert leave_together(first, limit=0.2) is False
    # worker 1 then finds worker 0's mark and leaves at once
    assert leave_together(resolve(jobs, "worker", 1), limit=5.0) is True
    assert leave_together(first, limit=5.0) is True


@pytest.mark.parametrize("limit", [0, -1.0])
def test_the_limit_must_be_positive(limit: float) -> None:
    jobs = _jobs()
    with pytest.raises(ValueError, match="limit"):
        leave_together(resolve(jobs, "worker", 0), limit=limit)


def test_a_client_outside_the_cluster_is_refused() -> None:
    jobs = _jobs()
    with pytest.raises(ValueError, match="leave_together"):
        leave_together(resolve(jobs), limit=1.0)


ROOT = Path(__file__).resolve().parent.parent.parent

CHILD = """
import json, sys
import tensorflow as tf
from towers.cluster.runtime import RuntimeStartedError, configure_gpus, runtime_started
out = {}
if sys.argv[1] == "cpu":
    out["before"] = runtime_started()
    out["chosen"] = configure_gpus(visible=[])            # first thing: hides every GPU
    out["logical_gpus"] = len(tf.config.list_logical_devices("GPU"))
    out["after"] = runtime_started()
    try:
        configure_gpus(memory_growth=False)
        out["late"] = "no error"
    except RuntimeStartedError as err:
        out["late"] = str(err)
else:
    growth = configure_gpus(visible=[0], memory_growth=True)
    out["growth"] = [growth, tf.config.experimental.get_memory_growth(
        tf.config.list_physical_devices("GPU")[0])]
    out["logical"] = [d.name for d in tf.config.list_logical_devices("GPU")]
print("RESULT " + json.dumps(out))
"""


def _child(mode: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True,
                          text=True, timeout=120)
    line = next((s for s in done.stdout.splitlines() if s.startswith("RESULT ")), None)
    assert line is not None, done.stdout + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("kwargs,error,match", [
    ({"visible": 0}, TypeError, "visible must be None or a list"),
    ({"visible": "0"}, TypeError, "visible must be None or a list"),
    ({"visible": [-1]}, ValueError, r"visible must hold GPU indices \(ints >= 0\)"),
    ({"visible": [True]}, ValueError, "visible must hold GPU indices"),
    ({"visible": [0, 0]}, ValueError, "visible names a GPU twice"),
    ({"memory_growth": 1}, TypeError, "memory_growth must be None, True or False"),
    ({"memory_limit_mb": 0}, ValueError, "memory_limit_mb must be an int >= 1"),
    ({"memory_limit_mb": 512.0}, TypeError, "memory_limit_mb must be None or an int"),
    ({"memory_growth": True, "memory_limit_mb": 512}, ValueError, "exclude each other"),
])
def test_bad_arguments_are_named_before_tensorflow_is_touched(kwargs: dict[str, Any],
                                                               error: type, match: str) -> None:
    # the runtime of this process started long ago: these fail on the arguments first
    assert runtime_started()
    with pytest.raises(error, match=match):
        configure_gpus(**kwargs)


def test_a_gpu_that_does_not_exist_is_named_with_those_that_do() -> None:
    missing = len(tf.config.list_physical_devices("GPU"))
    with pytest.raises(ValueError, match=rf"visible=\[{missing}\] asks for a GPU") as info:
        configure_gpus(visible=[missing])
    for name in (g.name for g in tf.config.list_physical_devices("GPU")):
        assert name in str(info.value)


def test_asking_nothing_after_the_runtime_started_returns_the_gpus() -> None:
    physical = [g.name for g in tf.config.list_physical_devices("GPU")]
    assert configure_gpus() == physical


@pytest.mark.long
def test_too_late_is_a_towers_runtime_error_and_first_thing_works() -> None:
    out = _child("cpu")
    assert out["before"] is False and out["after"] is True
    assert out["chosen"] == [] and out["logical_gpus"] == 0
    assert "must be called before TensorFlow initializes its devices" in out["late"]
    assert issubclass(RuntimeStartedError, TowersError)
    assert issubclass(RuntimeStartedError, RuntimeError)


@pytest.mark.skipif(not GPUS, reason="memory growth is only applied to a real GPU; none here")
def test_memory_growth_is_applied_to_the_visible_gpu() -> None:
    out = _child("gpu")
    assert out["growth"] == [["/physical_device:GPU:0"], True]
    assert out["logical"] == ["/device:GPU:0"]
