"""towers.bench.study: the same start for every reducer, bytes by each codec's formula, CSV and PNG.

One tiny study (the 64-32-10 MLP on 96 digits, 3 towers, 2 steps per reducer) runs
once for the module; every assertion reads its rows.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import DEVICES
from towers.allreduce.codecs import TopK
from towers.allreduce.machinery.resolve import parse
from towers.allreduce.ring import ring
from towers.bench.costmodel import predict_on
from towers.bench.study import plot, run_study, summary, summary_table, write_csv
from towers.training.data import digits
from towers.training.models import mlp

N = 3
SHAPES = [(64, 32), (32,), (32, 10), (10,)]  # the MLP's variables
SPECS = ["ring", "fp16", "topk(0.25)", "powersgd(2)"]
COLUMNS = [
    "reducer", "step", "epoch", "loss", "test_accuracy", "gradient_bytes",
    "gradient_bytes_per_tower", "bookkeeping_bytes", "cumulative_gradient_bytes",
    "predicted_s_8xH100", "cumulative_predicted_s_8xH100",
    "predicted_s_1024xH100", "cumulative_predicted_s_1024xH100",
]


def _ring(nbytes: int, itemsize: int = 4) -> int:
    return ring().bytes_sent(N, nbytes, itemsize)[0]


def _formula(spec: str) -> int:
    """Gradient bytes one tower sends per step, from each codec's own formula."""
    sizes = [math.prod(s) for s in SHAPES]
    if spec == "ring":  # one ring all-reduce per variable
        return sum(_ring(4 * s) for s in sizes)
    if spec == "fp16":  # x/n in float16: half the bytes, padded in float16 elements
        return sum(_ring(2 * s, 2) for s in sizes)
    if spec == "topk(0.25)":  # (int32 index, float32 value) pairs to each of n-1 decoders
        return sum((N - 1) * 8 * TopK(0.25).count(s) for s in sizes)
    total = 0  # powersgd(2): P (m×r) and Q (c×r) per matrix; vectors go exact
    for shape in SHAPES:
        total += _ring(4 * 2 * shape[0]) + _ring(4 * 2 * shape[1]) if len(shape) == 2 else (
            _ring(4 * shape[0]))
    return total


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    x, y, x_test, y_test = digits()
    data = (x[:96].reshape(96, -1), y[:96], x_test[:40].reshape(40, -1), y_test[:40])
    return run_study(SPECS, DEVICES[:N], model=lambda: mlp((64, 32, 10)), data=data,
                     batch_size=48, epochs=1, eval_every=1)


@pytest.mark.long
def test_every_reducer_starts_from_the_same_weights_and_batches(rows: list[dict]) -> None:
    assert [r["reducer"] for r in rows] == [s for s in SPECS for _ in range(2)]
    first = [r["loss"] for r in rows if r["step"] == 0]
    assert len(set(first)) == 1  # the first step's loss is computed before any reduction
    assert all(0 <= r["test_accuracy"] <= 1 for r in rows)


@pytest.mark.parametrize("spec", SPECS)
def test_gradient_bytes_follow_each_codecs_formula(rows: list[dict], spec: str) -> None:
    mine = [r for r in rows if r["reducer"] == spec]
    assert mine[0]["gradient_bytes_per_tower"] == _formula(spec)
    assert mine[0]["gradient_bytes"] == N * _formula(spec)  # every tower sends the same
    assert mine[1]["cumulative_gradient_bytes"] == 2 * N * _formula(spec)
    # towers 1 and 2 send their loss, example count and guard code (4 B each) to tower 0
    assert mine[0]["bookkeeping_bytes"] == (N - 1) * 12


def test_predicted_time_prices_the_all_reduce_calls(rows: list[dict]) -> None:
    ring_row = next(r for r in rows if r["reducer"] == "ring")
    for system in ("8xH100", "1024xH100"):
        expected = sum(predict_on(system, "ring", 4 * math.prod(s)) for s in SHAPES)
        assert ring_row[f"predicted_s_{system}"] == pytest.approx(expected, rel=1e-12)
    fp16 = next(r for r in rows if r["reducer"] == "fp16")
    assert fp16["predicted_s_8xH100"] < ring_row["predicted_s_8xH100"]  # fewer bytes, same α


def test_csv_png_and_summary(rows: list[dict], tmp_path: Path) -> None:
    with write_csv(rows, tmp_path / "s.csv").open() as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == COLUMNS and len(read) == len(rows)
    path = plot(rows, tmp_path / "s.png")
    import matplotlib.image

    image = matplotlib.image.imread(path)  # a valid PNG, decoded
    assert image.ndim == 3 and image.shape[1] > 3 * image.shape[0] > 600
    assert np.ptp(image[..., :3]) > 0.5  # not blank: curves drawn
    table = summary_table(rows)
    assert all(spec in table for spec in SPECS) and "1024xH100" in table
    assert [s["reducer"] for s in summary(rows)] == SPECS


@pytest.mark.parametrize("spec, message", [
    ("", "non-empty"),
    ("zip", "unknown reducer 'zip'"),
    ("topk(2)", "ratio must be a number in \\(0, 1\\]"),
    ("topk(x)", "Python literals"),
    ("fp16@nowhere", "unknown all_reduce 'nowhere'"),
    ("ring@tree", "ring is an all-reduce"),
    ("ring(2)", "an all-reduce takes no arguments here"),
    ("no_such_module_here:fn", "cannot import"),
], ids=["empty", "unknown", "bad-ratio", "not-literal", "bad-algorithm", "two-algorithms",
        "algorithm-arguments", "no-module"])
def test_bad_specs_are_refused_before_training(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(spec)


def test_specs_name_codecs_algorithms_and_users_codecs(tmp_path: Path, monkeypatch) -> None:
    assert parse("ring").codec is None and parse("ring").algorithm == "ring"
    assert parse("powersgd(4)@tree").algorithm == "tree"
    (tmp_path / "my_codecs.py").write_text(
        "from towers.allreduce.codecs import Cast\nimport tensorflow as tf\n"
        "def half():\n    return Cast(tf.float16)\n")
    monkeypatch.chdir(tmp_path)
    entry = parse("my_codecs.py:half@halving_doubling")
    assert (entry.codec, entry.algorithm) == ("my_codecs.py:half", "halving_doubling")


def test_one_tower_is_refused_before_training() -> None:
    with pytest.raises(ValueError, match="at least 2 towers, got 1"):
        run_study(["ring"], DEVICES[:1])
