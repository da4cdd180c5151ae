"""Peak RSS per configuration, each measured in its own child process."""

from __future__ import annotations

import pytest

from towers.bench.memory import run_memory, table


@pytest.mark.long
def test_each_configuration_gets_its_own_process_and_a_growing_peak() -> None:
    from towers.bench.memory import _peak_mib

    big = b"x" * (1 << 30)  # this process now peaks past 1 GiB more; its children must not
    rows = run_memory(["towers naive/parameter_device", "towers nope/replicated"],
                      towers=2, batch=8, steps=1)
    good, bad = rows
    assert good["imported_mib"] < _peak_mib() - 1000 and len(big) == 1 << 30
    assert good["error"] == "" and good["towers"] == 2
    # a fresh process: TensorFlow's import alone is hundreds of MiB, and the peak only grows
    assert 100 < good["imported_mib"] <= good["built_mib"] <= good["peak_mib"]
    assert good["peak_mib"] - good["imported_mib"] > 1  # the build and the step show up
    assert good["step_mib"] == good["peak_mib"] - good["built_mib"]
    assert bad["error"].startswith("exit ") and "peak_mib" not in bad  # an unknown algorithm
    assert "naive/parameter_device" in table(rows) and "exit" in table(rows)


def test_sharded_adam_state_per_tower_is_a_quarter_on_four_towers() -> None:
    from tests.conftest import DEVICES
    from towers.bench.memory import optimizer_state

    replicated, sharded = optimizer_state(DEVICES[:4])
    assert (replicated["placement"], sharded["placement"]) == ("replicated", "sharded")
    # 2 Adam slots per weight; sharded: each tower owns ceil(size/4) of every variable
    assert replicated["max_bytes_per_tower"] > 8 * 5_000_000
    assert 0.25 <= sharded["ratio_to_replicated"] < 0.2501
    assert sharded["total_bytes"] < replicated["total_bytes"] / 3.99
