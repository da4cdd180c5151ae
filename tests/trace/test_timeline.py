"""towers timeline: a loadable chrome-trace JSON with events for every tower and every tick.

In-process on conftest's devices: ``start_devices`` is replaced by a prefix of
``DEVICES`` so no other device count is ever asked of TensorFlow here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import towers.trace.schedule as trace
from tests.conftest import DEVICES
from towers import cli


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
