"""towers.devices: simulated devices, too-late calls, canonical names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import towers
from tests.conftest import DEVICES, GPUS, MAX_TOWERS
from towers.devices import canonical_device, has_gpu, one_memory

ROOT = Path(__file__).resolve().parents[1]


def test_same_count_again_is_a_no_op() -> None:
    assert towers.simulate_devices(MAX_TOWERS, kind="cpu") == DEVICES
    assert towers.simulate_devices(MAX_TOWERS, kind="CPU") == DEVICES
    assert len(set(DEVICES)) == MAX_TOWERS
    assert all("CPU" in d for d in DEVICES)


def test_the_suite_leaves_real_gpus_whole() -> None:
    """conftest splits the CPU only: every GPU the runtime lists is a physical one."""
    import tensorflow as tf

    assert len(GPUS) == len(tf.config.list_physical_devices("GPU"))


@pytest.mark.parametrize("bad", ["tpu", "", 3])
def test_kind_must_be_cpu_or_gpu(bad: object) -> None:
    with pytest.raises(ValueError, match="kind must be 'cpu', 'gpu' or None"):
        towers.simulate_devices(2, kind=bad)  # type: ignore[arg-type]


@pytest.mark.skipif(has_gpu(), reason="checks the message on a machine without a GPU")
def test_gpu_kind_without_a_gpu_says_so() -> None:
    with pytest.raises(ValueError, match="needs a physical GPU"):
        towers.simulate_devices(2, kind="gpu")


def test_other_count_after_start_says_call_it_first() -> None:
    with pytest.raises(RuntimeError, match="first thing"):
        towers.simulate_devices(3)


@pytest.mark.parametrize("bad", [0, -2])
def test_count_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        towers.simulate_devices(bad)


@pytest.mark.parametrize("bad", [2.0, "4", True])
def test_count_must_be_an_int(bad: object) -> None:
    with pytest.raises(TypeError, match="n must be an int"):
        towers.simulate_devices(bad)  # type: ignore[arg-type]


def test_local_devices_lists_the_simulated_ones() -> None:
    assert towers.local_devices("CPU") == DEVICES
    if not has_gpu():
        assert towers.local_devices() == DEVICES  # the default kind: GPU if any, else CPU
    with pytest.raises(ValueError, match="kind must be"):
        towers.local_devices("TPU")


def test_canonical_names() -> None:
    assert canonical_device("/job:localhost/replica:0/task:0/device:CPU:3") == "/device:CPU:3"
    assert canonical_device("/cpu:2") == "/device:CPU:2"
    assert canonical_device("") == ""


def test_fresh_process_gets_exactly_n_devices() -> None:
    code = (
        "import towers; d = towers.simulate_devices(3, kind='cpu'); "
        "print(len(d), d[-1], towers.simulate_devices(3, kind='cpu') == d)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
        env=env, cwd=ROOT,
    ).stdout.split()
    assert out == ["3", "/device:CPU:2", "True"]


@pytest.mark.parametrize("names, shared", [
    (["/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:3"], True),
    (["/device:CPU:1"], True),
    (["/job:worker/replica:0/task:1/device:CPU:0",
      "/job:worker/replica:0/task:1/device:CPU:1"], True),
    (["/job:worker/replica:0/task:0/device:CPU:0",
      "/job:worker/replica:0/task:1/device:CPU:0"], False),
    (["/device:GPU:0", "/device:GPU:1"], False),
    (["/device:CPU:0", "/device:GPU:0"], False),
    ([], False),
])
def test_one_memory_means_cpus_of_one_task(names: list[str], shared: bool) -> None:
    assert one_memory(names) is shared
