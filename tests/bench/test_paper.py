"""Scale on paper: the cost model at 8 and 1024 H100s against the published anchor."""

from __future__ import annotations

import pytest

from towers.bench.costmodel import PRESETS, SYSTEMS, predict, predict_on, scale_on_paper

IB_400G = PRESETS["ib-400g"]


def _row(rows: list[dict], system: str, algorithm: str, size: int) -> dict:
    [row] = [r for r in rows if (r["system"], r["algorithm"], r["size"]) == (system, algorithm,
                                                                             size)]
    return row


def test_the_ring_on_8_h100_lands_on_nccl_tests_published_busbw() -> None:
    rows = scale_on_paper(("ring",), sizes=(1 << 30,))
    ring = _row(rows, "8xH100", "ring", 1 << 30)
    assert ring["busbw"] == pytest.approx(ring["anchor_busbw"], rel=0.05)  # 370 GB/s


def test_no_flat_algorithm_beats_the_line_rate_at_1024_gpus() -> None:
    rows = [r for r in scale_on_paper() if r["system"] == "1024xH100"]
    assert rows
    for r in rows:
        if r["algorithm"] != "hierarchical":  # the only one that uses NVLink inside a node
            assert r["busbw"] <= IB_400G.bandwidth / 1e9 * (1 + 1e-9), r


def test_hierarchical_at_scale_pays_nvlink_inside_a_node_and_ib_between() -> None:
    params = {"inner": "ring", "outer": "ring", "group_size": 8}
    both_ib = predict("hierarchical", 1024, 1 << 30, IB_400G, **params)
    row = _row(scale_on_paper(("hierarchical",), sizes=(1 << 30,)), "1024xH100", "hierarchical",
               1 << 30)
    assert row["time_us"] * 1e-6 < both_ib  # the fast inner link is really used
    assert row["time_us"] * 1e-6 == pytest.approx(
        predict("hierarchical", 1024, 1 << 30, IB_400G, inner_link=PRESETS["h100-nvlink"],
                **params))
    assert SYSTEMS["1024xH100"]["n"] == 1024


def test_predict_on_a_system_is_the_table_and_names_unknown_systems() -> None:
    row = next(r for r in scale_on_paper(["ring"], [1 << 20]) if r["system"] == "1024xH100")
    assert predict_on("1024xH100", "ring", 1 << 20) * 1e6 == pytest.approx(row["time_us"])
    with pytest.raises(ValueError, match="unknown system '9xTPU'; known: 8xH100, 1024xH100"):
        predict_on("9xTPU", "ring", 1.0)
