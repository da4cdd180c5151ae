"""``towers bench --workers``: a real 2-process run at 1 MB, and the table's arithmetic."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from towers.bench import workers


@pytest.mark.long
def test_two_workers_time_every_implementation(tmp_path: Path) -> None:
    # each worker checks every output element (an all-reduce of ones must give W)
    assert workers.run(2, tmp_path, [1], rounds=1, timeout=240) == 0
    with open(tmp_path / "workers.csv", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    assert [r["impl"] for r in table] == ["CrossWorker", "AllTowers", "MWMS"]
    assert all(float(r["median_s"]) > 0 and r["megabytes"] == "1" for r in table)
    assert table[2]["ratio_to_mwms"] == "1.000"


def test_bandwidths_and_ratios_follow_their_definitions() -> None:
    result = {"workers": 4, "megabytes": 2,
              "median_s": {"CrossWorker": 0.5, "AllTowers": 2.0, "MWMS": 1.0},
              "min_s": {"CrossWorker": 0.25, "AllTowers": 1.0, "MWMS": 0.5}}
    rows = {r["impl"]: r for r in workers.rows([result])}
    size = 2 * 2**20
    assert rows["CrossWorker"]["algbw_GBps"] == f"{size / 0.5 / 1e9:.3f}"
    assert rows["CrossWorker"]["busbw_GBps"] == f"{size / 0.5 / 1e9 * 2 * 3 / 4:.3f}"
    assert [rows[k]["ratio_to_mwms"] for k in ("CrossWorker", "AllTowers", "MWMS")] == \
        ["0.500", "2.000", "1.000"]
    assert rows["AllTowers"]["min_s"] == "1.00000"


@pytest.mark.parametrize(("args", "message"), [
    ((1, [1], 3), "workers must be an int >= 2, got 1"),
    ((2, [0], 3), r"sizes \(MB\) must be an int >= 1, got 0"),
    ((2, [1], 0), "rounds must be an int >= 1, got 0"),
])
def test_bad_arguments_are_named(
    args: tuple[int, list[int], int], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=message):
        workers.run(args[0], tmp_path, args[1], rounds=args[2])
