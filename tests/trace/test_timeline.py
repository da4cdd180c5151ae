"""towers timeline: a loadable chrome-trace JSON with events for every tower and every tick,
and the measured timeline: tf.profiler's op events of one real step.

In-process on conftest's devices: ``start_devices`` is replaced by a prefix of
``DEVICES`` so no other device count is ever asked of TensorFlow here. One profiled
``train_step`` on two of them: its op events parse, have positive durations, and every
tower shows forward and backward op time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import towers.trace.schedule as trace
from tests.conftest import DEVICES
from towers import cli
from towers.trace.timeline import (
    OpEvent,
    busy,
    digits_trainer,
    draw_measured,
    phase_of,
    profile_step,
    split_compute,
)


def _complete(data: dict) -> list[dict]:
    return [e for e in data["traceEvents"] if e["ph"] == "X"]


def test_ring_step_has_every_tower_and_tick(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(trace, "start_devices", lambda n: DEVICES[:n])
    out = tmp_path / "step.json"
    code = cli.main(["timeline", "--towers", "3", "--algorithm", "ring", "--repeats", "1",
                     "--batch-size", "12", "--out", str(out),
                     "--measured", str(tmp_path / "measured.png")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(out.read_text())  # it loads
    events, n, ticks = _complete(data), 3, 2 * (3 - 1)
    assert data["otherData"]["ticks"] == ticks and "measured" in data["otherData"]["timings"]
    for e in events:  # well-formed complete events
        assert {"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0 and e["ts"] >= 0
    for tower in range(n):
        names = [e["name"] for e in events if e["pid"] == tower]
        assert names[:2] == ["forward", "backward"] and "apply" in names
        here = sorted(e["args"]["tick"] for e in events if e["pid"] == tower and e["tid"] == 1)
        assert here == list(range(ticks))  # in a ring every tower works every tick
    # Phases follow each other: reduction after the slowest backward, apply after the ticks.
    end_of_compute = max(e["ts"] + e["dur"] for e in events if e["name"] == "backward")
    reduce = [e for e in events if e["tid"] == 1]
    assert min(e["ts"] for e in reduce) == pytest.approx(end_of_compute, abs=0.01)
    assert min(e["ts"] for e in events if e["name"] == "apply") == pytest.approx(
        max(e["ts"] + e["dur"] for e in reduce), abs=0.01)
    meta = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert meta[0].startswith("tower 0") and meta[n].startswith("whole step")
    assert "whole step, compiled" in printed and "/phase" in printed  # the progress bar
    # Backward passes come from the profiler's op times: never the 0.000 of a subtraction.
    assert all(e["dur"] > 0 for e in events if e["name"] in ("forward", "backward"))
    assert data["measuredOps"] and all(op[4] > 0 for op in data["measuredOps"])
    assert (tmp_path / "measured.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_describes_the_options_and_the_timings(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["timeline", "--help"])
    text = capsys.readouterr().out
    for option in ("--towers", "--algorithm", "--variables", "--batch-size", "--repeats",
                   "--out", "What the numbers mean", "examples:"):
        assert option in text


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
