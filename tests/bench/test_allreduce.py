"""The all-reduce table at tiny sizes: every row checked against NumPy, nccl-tests columns."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers import allreduce
from towers.allreduce import Algorithm, naive
from towers.bench import allreduce as bench
from towers.bench import floors
from towers.bench.report import allreduce_table

COLUMNS = {"size", "count", "type", "redop", "algorithm", "time_us", "algbw", "busbw", "wrong"}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    names = ["naive", "ring", "tree", "hierarchical", "tf.CollectiveAllReduce",
             "tf.ReductionToOneDevice"]
    return bench.run_allreduce(DEVICES[:3], [4096, 16384], algorithms=names, rounds=2)


def test_every_row_is_right(rows: list[dict]) -> None:
    ran = [r for r in rows if not r["error"]]
    assert {r["algorithm"] for r in ran} >= {"naive", "ring", "tf.CollectiveAllReduce"}
    # pieces of a chunked schedule, not sums
    parts = {floors.LEAF_ADDS, floors.CHAIN_ADDS, floors.ASSEMBLY}
    assert all(r["wrong"] == 0 for r in ran if r["algorithm"] not in parts), \
        [(r["algorithm"], r["wrong"]) for r in ran]


def _needs_four_towers(values, *, op="sum"):  # type: ignore[no-untyped-def]
    if len(values) != 4:
        raise ValueError(f"needs_four: built for 4 towers, got {len(values)}")
    return naive(values, op=op)


def test_a_contender_that_cannot_run_gets_a_row_with_the_reason(monkeypatch) -> None:
    record = Algorithm("needs_four", lambda: _needs_four_towers)
    monkeypatch.setitem(allreduce.ALGORITHMS, "needs_four", record)
    rows = bench.run_allreduce(DEVICES[:3], [4096], algorithms=["needs_four", "naive"], rounds=1)
    failed = [r for r in rows if r["algorithm"] == "needs_four"]
    assert failed and all("built for 4 towers" in r["error"] for r in failed)
    assert all(not r["error"] for r in rows if r["algorithm"] == "naive")
    assert "needs_four: not run" in allreduce_table(rows)


def test_columns_and_busbw_formula(rows: list[dict]) -> None:
    for r in rows:
        assert set(r) >= COLUMNS
        if r["error"] or r["kind"] == "calibration":
            continue
        assert r["count"] * 4 == r["size"]
        assert r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (3 - 1) / 3)
    calibration = {r["algorithm"]: r for r in rows if r["kind"] == "calibration"}
    assert set(calibration) == {"send", "add", "one-pass (NumPy)", floors.LEAF_ADDS,
                                floors.CHAIN_ADDS, floors.ASSEMBLY}
    one_pass = calibration["one-pass (NumPy)"]  # the memory limit the targets compare with
    assert one_pass["wrong"] == 0 and one_pass["algbw"] > 0 and one_pass["formula"] is None


def test_table_has_nccl_tests_columns(rows: list[dict]) -> None:
    head = allreduce_table(rows).splitlines()[0].split()
    assert head[:4] == ["size", "count", "type", "redop"]
    assert {"algbw", "busbw", "#wrong"} <= set(head)
    assert not any(line.split()[4] == "send" for line in allreduce_table(rows).splitlines()[2:]
                   if len(line.split()) > 4)


def test_count_wrong_sees_a_wrong_output_and_a_misplaced_one() -> None:
    devices = DEVICES[:2]
    inputs = bench.make_inputs(devices, 64)
    host = [x.numpy() for x in inputs]
    noop = bench.Contender("noop", "towers", lambda v: list(v))
    compiled = bench.Compiled(noop, devices)
    outs = compiled(*inputs)
    total = host[0] + host[1]
    expected = sum(int(np.count_nonzero(h != total)) for h in host)
    assert bench.count_wrong(noop, outs, host, devices, compiled.homes) == expected > 0
    good = [tf.constant(host[0] + host[1])] * 2
    assert bench.count_wrong(noop, good, host, devices, devices) == 0
    assert bench.count_wrong(noop, good, host, devices, devices[::-1]) == 32


def test_inputs_are_small_integers_on_their_devices() -> None:
    inputs = bench.make_inputs(DEVICES[:2], 4096)
    assert [x.device.endswith(f"CPU:{i}") for i, x in enumerate(inputs)] == [True, True]
    data = inputs[0].numpy()
    assert data.dtype == np.float32 and data.size == 1024
    assert np.all(data == np.round(data)) and np.abs(data).max() <= 64


def test_short_calls_are_averaged_over_several_calls() -> None:
    assert bench.calls_per_sample(4096) > bench.calls_per_sample(1 << 26) == 1


def test_sizes_must_be_whole_float32_elements() -> None:
    with pytest.raises(ValueError, match="multiples of 4"):
        bench.run_allreduce(DEVICES[:2], [4098], algorithms=["naive"])


def test_the_targets_compare_the_best_algorithm_with_mirrored_and_the_one_pass_limit() -> None:
    from towers.bench import targets

    def row(name: str, kind: str, algbw: float, size: int = 1 << 26) -> dict:
        return {"algorithm": name, "kind": kind, "algbw": algbw, "size": size}

    rows = [row("naive", "towers", 3.0), row("ring", "towers", 1.5), row("naive", "towers", 9.0, 4),
            row("tf.CollectiveAllReduce", "tf.distribute", 1.2),
            row("one-pass (NumPy)", "calibration", 5.0)]
    mirrored, one_pass = targets.targets({"allreduce": rows})
    assert mirrored["value"] == pytest.approx(3.0 / 1.2) and not mirrored["holds"]
    assert one_pass["value"] == pytest.approx(3.0 / 5.0) and not one_pass["holds"]
    assert "naive" in one_pass["detail"] and one_pass["limit"] == 0.70
    rows[-1]["algbw"] = 4.0
    assert targets.targets({"allreduce": rows})[1]["holds"]  # 0.75 >= 0.70


def test_chunked_targets_set_each_schedule_beside_naive_and_its_floor() -> None:
    from towers.bench import targets

    def row(name: str, kind: str, us: float, share: float | None = None) -> dict:
        return {"algorithm": name, "kind": kind, "time_us": us, "size": 1 << 26, "n": 4,
                "chunked": share is not None, "leaf_share": share,
                "algbw": (1 << 26) / us / 1e3}

    rows = [row("naive", "towers", 100.0), row("tree", "towers", 110.0),
            row("ring", "towers", 125.0, 1 / 3), row("swing", "towers", 190.0, 2 / 3),
            row("add", "calibration", 98.0), row(floors.LEAF_ADDS, "calibration", 130.0),
            row(floors.CHAIN_ADDS, "calibration", 100.0),
            row(floors.ASSEMBLY, "calibration", 35.0)]
    add, ring, swing = targets.targets({"allreduce": rows})
    assert add["value"] == pytest.approx(0.98) and add["holds"]  # 98 / 100 >= 0.95
    assert ring["value"] == pytest.approx(1.25) and ring["holds"]
    assert swing["value"] == pytest.approx(1.9) and not swing["holds"]
    # its additions priced at 2/3 leaves: 100 + 30 / 2, then the assembly: 150 us
    assert "leaf share 0.67, parts in sequence 1.50 x naive, measured 1.27 x the parts" in (
        swing["detail"])
    assert "parts in sequence 1.35 x naive" in ring["detail"]
    rows[4]["time_us"] = 90.0
    assert not targets.targets({"allreduce": rows})[0]["holds"]  # 0.90 < 0.95




def test_every_registered_algorithm_hands_the_cost_model_params_it_takes() -> None:
    """The full bench fits every algorithm: a run-time setting in a record's params (a
    collective's timeout) must not reach the cost formula."""
    from towers import allreduce
    from towers.bench import costmodel
    from towers.bench.allreduce import towers_contender

    for name in allreduce.ALGORITHMS:
        contender = towers_contender(name)
        if contender.formula is not None:
            costmodel.coefficients(contender.formula, 4, 4096.0, **contender.params)
