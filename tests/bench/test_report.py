"""Tables, CSV, JSON and PNG output."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from towers.bench import report

ROW = {"size": 4096, "count": 1024, "type": "float", "redop": "sum", "algorithm": "ring",
       "kind": "towers", "time_us": 100.0, "algbw": 0.041, "busbw": 0.061, "wrong": 0,
       "min_us": 90.0, "cpu_us": 120.0, "params": {"subchunks": 1}, "error": ""}


def test_format_table_aligns_two_header_lines() -> None:
    text = report.allreduce_table([ROW, {**ROW, "algorithm": "tf.CollectiveAllReduce"}])
    lines = text.splitlines()
    assert len(lines) == 4 and lines[1].strip().startswith("(B)")
    assert len({len(line) for line in lines[2:]}) == 1


def test_csv_and_json_round_trip(tmp_path: Path) -> None:
    rows = [ROW, {**ROW, "algbw": math.nan, "extra": 1}]
    path = report.write_csv(tmp_path / "sub" / "t.csv", rows)
    with path.open() as f:
        read = list(csv.DictReader(f))
    assert read[0]["algorithm"] == "ring" and json.loads(read[0]["params"]) == {"subchunks": 1}
    assert "extra" in read[0]
    data = json.loads(report.write_json(tmp_path / "t.json", {"rows": rows}).read_text())
    assert data["rows"][1]["algbw"] is None


def test_plots_are_png(tmp_path: Path) -> None:
    rows = [ROW, {**ROW, "size": 16384, "algbw": 0.1}]
    png = report.plot_algbw(rows, tmp_path / "a.png")
    steps = [{"model": "m", "config": c, "kind": k, "ratio": v} for c, k, v in
             [("MirroredStrategy", "tf.distribute", 1.0), ("towers naive", "towers", 0.7)]]
    bars = report.plot_ratios(steps, tmp_path / "b.png")
    for path in (png, bars):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_costmodel_tables_mark_training_rows_and_name_the_splits() -> None:
    detail = {"algorithm": "ring", "nbytes": 4096, "measured": 1e-3, "predicted": 1.1e-3,
              "rel_error": 0.1, "interleaved_train": True, "interleaved_error": 0.0,
              "extrapolated_train": False, "extrapolated_error": -0.5}
    short = {"algorithm": "tree", "nbytes": 4096, "measured": 1e-3, "predicted": 1e-3,
             "rel_error": 0.0, "interleaved_train": None, "extrapolated_train": None}
    summary = {"algorithm": "ring", "formula": "ring", "alpha": 1e-4, "per_byte": 1e-9,
               "median_abs_error": 0.05, "max_abs_error": 0.1, "ok": True,
               "interleaved_median_abs_error": 0.02, "interleaved_max_abs_error": 0.03,
               "interleaved_ok": True, "extrapolated_median_abs_error": 0.4,
               "extrapolated_max_abs_error": 0.5, "extrapolated_ok": False}
    splits = {"interleaved": ([4096.0, 65536.0], [16384.0]), "extrapolated": ([4096.0], [])}
    text = report.costmodel_tables([detail, short], [summary], splits, 0.25)
    assert "interleaved: fitted on 4096, 65536 B only; predicts 16384 B" in text
    assert "extrapolated: too few sizes to hold any out" in text
    ring, tree = (line.split() for line in text.splitlines() if " 4096 " in line)
    assert ring[-2:] == ["train", "-50.0"] and tree[-2:] == ["-", "-"]
    last = text.splitlines()[-1].split()
    assert last[-7:] == ["5.0", "10.0", "2.0", "3.0", "40.0", "50.0", "yes/yes/NO"]
    assert "within 25%" in text
