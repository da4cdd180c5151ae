"""``towers bench`` end to end at tiny sizes: tables printed, files written, exit code 0."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from towers.cli.bench import add_arguments, run


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_writes_its_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--towers", "2", "--sizes", "4096,8192", "--rounds", "2", "--quiet",
                 "--algorithms", "naive,tf.ReductionToOneDevice", "--models", "conv-mnist",
                 "--batch-size", "8", "--step-rounds", "1", "--placements", "parameter_device",
                 "--scaling-towers", "2", "--out", str(tmp_path),
                 "--sections", "allreduce,costmodel,training,scaling,phases")  # memory: own test
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "#wrong" in out and "ratio to" in out and "targets" in out
    for name in ("bench.json", "allreduce.csv", "costmodel.csv", "training.csv", "scaling.csv",
                 "allreduce_algbw.png", "training_ratio.png", "graph_cost.png", "phases.csv",
                 "phases.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {"environment", "allreduce", "costmodel", "training", "scaling", "targets",
            "phases"} <= set(data)
    assert len(data["environment"]["load_average"]) == 3
    pieces = ("leaf adds", "chain adds", "assembly")
    parts = [r for r in data["allreduce"] if r["algorithm"] in pieces]
    assert {r["wrong"] for r in parts} == {None}  # a chunked schedule's pieces, not sums
    assert all(r["wrong"] == 0 for r in data["allreduce"] if r not in parts)


def test_unknown_section_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:  # while parsing, before any work
        _args("--sections", "nope", "--out", str(tmp_path), "--towers", "2")
    assert info.value.code == 2
