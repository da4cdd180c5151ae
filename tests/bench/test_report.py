"""Interleaved timing; tables, CSV, JSON and PNG output."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from towers.bench import allreduce, report, training
from towers.bench.costfit import FIT_COLUMNS
from towers.bench.report import Samples, interleave, paired_ratio

ROW = {"size": 4096, "count": 1024, "type": "float", "redop": "sum", "algorithm": "ring",
       "kind": "towers", "time_us": 100.0, "algbw": 0.041, "busbw": 0.061, "wrong": 0,
       "min_us": 90.0, "cpu_us": 120.0, "params": {"subchunks": 1}, "error": ""}


def test_format_table_aligns_two_header_lines() -> None:
    text = allreduce.table([ROW, {**ROW, "algorithm": "tf.CollectiveAllReduce"}])
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
    png = allreduce.plot(rows, tmp_path / "a.png", "title")
    steps = [{"model": "m", "config": c, "kind": k, "ratio": v} for c, k, v in
             [("MirroredStrategy", "tf.distribute", 1.0), ("towers naive", "towers", 0.7)]]
    bars = training.plot(steps, tmp_path / "b.png")
    for path in (png, bars):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_costmodel_table_shows_the_fit_as_bandwidth_and_percent() -> None:
    fitted = {"algorithm": "ring", "formula": "ring", "alpha": 2e-5, "per_byte": 1e-9,
              "fit_median_error": 0.05, "fit_max_error": 0.1, "held_out_median_error": 0.02,
              "held_out_max_error": 0.03}
    short = {**fitted, "algorithm": "tree", "formula": "tree", "per_byte": 0.0,
             "held_out_median_error": None, "held_out_max_error": None}
    lines = report.format_table(FIT_COLUMNS, [fitted, short]).splitlines()
    assert lines[0].split()[:4] == ["algorithm", "formula", "alpha", "1/(2beta+gamma)"]
    assert lines[2].split() == ["ring", "ring", "20.0", "1.00", "5.0", "10.0", "2.0", "3.0"]
    assert lines[3].split()[3:] == ["inf", "5.0", "10.0", "-", "-"]


def test_interleave_samples_every_function_each_round() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    out = interleave(fns, rounds=4, calls=2, warmup=1)
    assert set(out) == {"a", "b", "c"}
    assert all(len(s.wall) == 4 and len(s.cpu) == 4 for s in out.values())
    assert len(calls) == 3 * (1 + 4 * 2)
    rounds = [calls[3 + 6 * r: 3 + 6 * (r + 1)] for r in range(4)]
    assert all(sorted(set(r)) == ["a", "b", "c"] for r in rounds)


def test_calls_per_sample_can_differ_per_function() -> None:
    counts = {"a": 0, "b": 0}

    def bump(name: str) -> None:
        counts[name] += 1

    interleave({k: (lambda k=k: bump(k)) for k in counts}, rounds=2, calls={"a": 3}, warmup=0)
    assert counts == {"a": 6, "b": 2}


def test_interleave_rejects_zero_rounds() -> None:
    with pytest.raises(ValueError, match="rounds"):
        interleave({"a": lambda: None}, rounds=0)


def test_paired_ratio_is_the_median_of_per_round_ratios() -> None:
    a = Samples(wall=[2.0, 4.0, 9.0], cpu=[0, 0, 0])
    b = Samples(wall=[1.0, 2.0, 3.0], cpu=[0, 0, 0])
    assert paired_ratio(a, b) == 2.0
    assert a.median == 4.0 and a.minimum == 2.0

