"""towers.devices: simulated devices, too-late calls, canonical names."""

from __future__ import annotations

import subprocess
import sys

import pytest

import towers
from tests.conftest import DEVICES, MAX_TOWERS
from towers.devices import canonical_device


def test_same_count_again_is_a_no_op() -> None:
    assert towers.simulate_devices(MAX_TOWERS) == DEVICES
    assert len(set(DEVICES)) == MAX_TOWERS


def test_other_count_after_start_says_call_it_first() -> None:
    with pytest.raises(RuntimeError, match="first thing"):
        towers.simulate_devices(3)


@pytest.mark.parametrize("bad", [0, -2])
def test_count_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="n must be at least 1"):
        towers.simulate_devices(bad)


@pytest.mark.parametrize("bad", [2.0, "4", True])
def test_count_must_be_an_int(bad: object) -> None:
    with pytest.raises(TypeError, match="n must be an int"):
        towers.simulate_devices(bad)  # type: ignore[arg-type]


def test_local_devices_lists_the_simulated_ones() -> None:
    assert towers.local_devices() == DEVICES
    with pytest.raises(ValueError, match="kind must be"):
        towers.local_devices("TPU")


def test_canonical_names() -> None:
    assert canonical_device("/job:localhost/replica:0/task:0/device:CPU:3") == "/device:CPU:3"
    assert canonical_device("/cpu:2") == "/device:CPU:2"
    assert canonical_device("") == ""


def test_fresh_process_gets_exactly_n_devices() -> None:
    code = "import towers; print(len(towers.simulate_devices(3)), towers.simulate_devices(3)[-1])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    assert out[0] == "3"
    assert out[1].endswith("CPU:2")
