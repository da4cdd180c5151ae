"""The measured timeline (towers.trace.measured): tf.profiler's op events of one real step.

One profiled ``train_step`` on two of conftest's logical CPUs: its op events parse,
have positive durations, and every tower shows forward and backward op time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import DEVICES
from towers.trace.measured import (
    OpEvent,
    busy,
    draw_measured,
    phase_of,
    profile_step,
    split_compute,
)
from towers.trace.timeline import digits_trainer


@pytest.mark.parametrize(("name", "expected"), [
    ("replica_3/conv2d_1/Relu", (3, "forward")),
    ("gradient_tape/replica_12/dense/MatMul", (12, "backward")),
    ("conv2d_1/Relu", (0, "forward")),  # tower 0: MirroredStrategy's replica 0 names
    ("gradient_tape/dense/MatMul", (0, "backward")),
    ("guard/IsFinite", (None, "step")),
    ("split/strided_slice", (None, "step")),
    ("Identity_10", (None, "step")),  # the nested update's arguments
    ("a_replica_1/x", (0, "forward")),  # not a replica scope: a path component must match
], ids=["forward", "backward", "tower-0-forward", "tower-0-backward", "guard", "split",
        "handoff", "not-a-scope"])
def test_ops_are_sorted_into_phases_by_scope(name: str, expected: tuple) -> None:
    assert phase_of(name) == expected


def test_busy_time_is_the_union_of_intervals() -> None:
    events = [OpEvent("a", "A", "t", 0.0, 10.0), OpEvent("b", "B", "u", 5.0, 10.0),
              OpEvent("gradient_tape/c", "C", "t", 20.0, 1.0)]
    assert busy(events, 1) == {(0, "forward"): 15.0, (0, "backward"): 1.0}
    assert split_compute([2.0], events) == ([2.0 * 15 / 16], [2.0 * 1 / 16])
    assert split_compute([2.0, 1.0], events) is None  # tower 1 was never seen


def test_a_profiled_step_has_real_forward_and_backward_on_every_tower(tmp_path: Path) -> None:
    trainer, batch = digits_trainer(DEVICES[:2], batch_size=16)
    events = profile_step(trainer, *batch)
    assert len(events) > 50 and all(e.duration > 0 and e.start >= 0 for e in events)
    spent = busy(events, 2)
    for tower in range(2):
        assert spent[(tower, "forward")] > 0 and spent[(tower, "backward")] > 0
    assert any(e.op == "Conv2DBackpropInput" or "Backprop" in e.op for e in events)
    png = draw_measured(events, 2, tmp_path / "measured.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
