"""The input-pipeline table on a small batch: every configuration trains on the same batch."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.conftest import DEVICES
from towers.bench import pipeline
from towers.split import PIPELINES


@pytest.mark.long
def test_the_section_times_every_configuration_from_the_same_loss(tmp_path: Path) -> None:
    args = argparse.Namespace(models=["conv-mnist"], step_rounds=1, quick=True, towers=2,
                              batch_size=5, quiet=True, out=tmp_path)  # fmt: skip
    results: dict = {}
    assert pipeline.pipeline_section(args, DEVICES[:2], results)
    rows = results["pipeline"]
    assert [r["config"] for r in rows] == [
        pipeline.HOST, *(f"pipeline {p}" for p in PIPELINES), "fixed batch", "fixed shards"]
    # bitwise: the pipeline's step is host slicing's, on the same first batch (5 over 2: [3, 2])
    assert len({r["first_loss"] for r in rows}) == 1
    assert all(r["ms"] > 0 and r["cpu_ms"] >= 0 for r in rows)
    assert next(r for r in rows if r["config"] == pipeline.HOST)["ratio"] == 1.0
    assert (tmp_path / "pipeline.csv").read_text().count("\n") == len(rows) + 1


def test_first_losses_that_differ_are_reported_wrong() -> None:
    rows = [{"model": "mlp", "config": c, "first_loss": v}
            for c, v in ((pipeline.HOST, 2.5), ("pipeline multi_device", 2.5))]
    assert pipeline.wrong_losses(rows) == []
    rows.append({"model": "mlp", "config": "pipeline per_device", "first_loss": 2.4999998})
    [line] = pipeline.wrong_losses(rows)
    assert "first losses of mlp differ" in line and "pipeline per_device" in line
