"""docs/tutorial.ipynb runs as written: its code cells, in order, in one namespace.

No Jupyter needed: the notebook's JSON is read and each code cell is exec'd in the
docs/ directory (the pictures it writes go to a temporary directory instead). Then
the promises its text makes are checked on what the cells computed: four towers give
the one-tower update, the ring's state is complete with α as the cost formula says,
the profiled timeline has real backward time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "tutorial.ipynb"


def _code_cells() -> list[str]:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


@pytest.mark.long
def test_every_code_cell_runs_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cells = _code_cells()
    assert len(cells) >= 5
    monkeypatch.chdir(tmp_path)  # the cells write their pictures to the working directory
    space: dict[str, Any] = {"__name__": "__tutorial__"}
    for k, source in enumerate(cells):
        exec(compile(source, f"{NOTEBOOK.name}[code cell {k}]", "exec"), space)
    out = capsys.readouterr().out
    assert "examples per tower: [16, 16, 16, 16]" in out
    assert "ring   ticks 6, bytes sent per tower [96, 96, 96, 96]" in out
    assert space["gap"] < 1e-6  # one tower and four: the same update up to float32 rounding
    state = space["state"]
    assert state.complete() and state.messages == state.alpha == 6
    assert all(e["dur"] > 0 for e in space["data"]["traceEvents"] if e["name"] == "backward")
    assert sorted(os.listdir(tmp_path)) == ["tutorial_ring_state.png", "tutorial_timeline.png"]
