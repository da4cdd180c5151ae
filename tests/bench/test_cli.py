"""``towers bench`` end to end at tiny sizes: tables printed, files written, exit code 0."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from towers.cli.bench import add_arguments, run

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_writes_its_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--towers", "2", "--sizes", "4096,8192", "--rounds", "2", "--quiet",
                 "--algorithms", "naive,tf.ReductionToOneDevice", "--models", "conv-mnist",
                 "--batch-size", "8", "--step-rounds", "1", "--placements", "parameter_device",
                 "--out", str(tmp_path),
                 "--sections", "allreduce,costmodel,training,phases")  # memory: own test
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "#wrong" in out and "ratio to" in out and "1/(2beta+gamma)" in out
    for name in ("bench.json", "allreduce.csv", "costmodel.csv", "training.csv",
                 "allreduce_algbw.png", "training_ratio.png", "phases.csv", "phases.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {"environment", "allreduce", "costmodel", "training", "phases"} <= set(data)
    assert len(data["environment"]["load_average"]) == 3
    assert all(r["wrong"] == 0 for r in data["allreduce"])


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in folder.rglob("*") if p.is_file()}


def test_by_default_a_fresh_folder_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--out`` the run writes a new folder where the user stands, twice two
    folders, and never the repository's ``benchmarks/``."""
    shipped = _files(ROOT / "benchmarks")
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert run(_args("--towers", "2", "--sections", "costmodel", "--quiet")) == 0
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == 2 and all(f.startswith("towers-bench-") for f in folders), folders
    for folder in folders:
        assert (tmp_path / folder / "bench.json").stat().st_size > 0
        assert (tmp_path / folder / "scale_on_paper.csv").stat().st_size > 0
    assert _files(ROOT / "benchmarks") == shipped
    assert f"wrote {tmp_path / folders[0] / 'bench.json'}" in capsys.readouterr().out


def test_unknown_section_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:  # while parsing, before any work
        _args("--sections", "nope", "--out", str(tmp_path), "--towers", "2")
    assert info.value.code == 2

