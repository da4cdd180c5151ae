"""The all-reduce table at tiny sizes: every row checked against NumPy, nccl-tests columns."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers import allreduce
from towers.allreduce import Algorithm, naive
from towers.bench import allreduce as bench

COLUMNS = {"size", "count", "type", "redop", "algorithm", "time_us", "algbw", "busbw", "wrong"}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    names = ["naive", "ring", "tree", "hierarchical", "tf.CollectiveAllReduce",
             "tf.ReductionToOneDevice"]
    return bench.run_allreduce(DEVICES[:3], [4096, 16384], algorithms=names, rounds=2)


def test_every_row_is_right(rows: list[dict]) -> None:
    ran = [r for r in rows if not r["error"]]
    assert {r["algorithm"] for r in ran} >= {"naive", "ring", "tf.CollectiveAllReduce"}
    assert all(r["wrong"] == 0 for r in ran), [(r["algorithm"], r["wrong"]) for r in ran]


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
    assert "needs_four: not run" in bench.table(rows)


def test_columns_and_busbw_formula(rows: list[dict]) -> None:
    for r in rows:
        assert set(r) >= COLUMNS
        if r["error"] or r["kind"] == "calibration":
            continue
        assert r["count"] * 4 == r["size"]
        assert r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (3 - 1) / 3)
    calibration = {r["algorithm"]: r for r in rows if r["kind"] == "calibration"}
    assert set(calibration) == {"send", "add"}
    assert all(r["formula"] == name and r["busbw"] is None for name, r in calibration.items())


def test_table_has_nccl_tests_columns(rows: list[dict]) -> None:
    head = bench.table(rows).splitlines()[0].split()
    assert head[:4] == ["size", "count", "type", "redop"]
    assert {"algbw", "busbw", "#wrong"} <= set(head)
    assert not any(line.split()[4] == "send" for line in bench.table(rows).splitlines()[2:]
                   if len(line.split()) > 4)


def test_count_wrong_sees_a_wrong_output_and_a_misplaced_one() -> None:
    devices = DEVICES[:2]
    inputs = bench.make_inputs(devices, 64)
    host = [x.numpy() for x in inputs]
    noop = bench.Contender("noop", "towers", lambda v: list(v))
    fn, homes = bench.compiled(noop, devices)
    outs = fn(*inputs)
    total = host[0] + host[1]
    expected = sum(int(np.count_nonzero(h != total)) for h in host)
    assert bench.count_wrong(noop, outs, host, devices, homes) == expected > 0
    good = [tf.constant(host[0] + host[1])] * 2
    assert bench.count_wrong(noop, good, host, devices, devices) == 0
    assert bench.count_wrong(noop, good, host, devices, devices[::-1]) == 32


def test_inputs_are_small_integers_on_their_devices() -> None:
    inputs = bench.make_inputs(DEVICES[:2], 4096)
    assert [x.device.endswith(f"CPU:{i}") for i, x in enumerate(inputs)] == [True, True]
    data = inputs[0].numpy()
    assert data.dtype == np.float32 and data.size == 1024
    assert np.all(data == np.round(data)) and np.abs(data).max() <= 64


def test_sizes_must_be_whole_float32_elements() -> None:
    with pytest.raises(ValueError, match="multiples of 4"):
        bench.run_allreduce(DEVICES[:2], [4098], algorithms=["naive"])


def test_every_registered_algorithm_hands_the_cost_model_params_it_takes() -> None:
    """The full bench fits every algorithm: a run-time setting in a record's params (a
    collective's timeout) must not reach the cost formula."""
    from towers.bench import costmodel

    for name in allreduce.ALGORITHMS:
        contender = bench.towers_contender(name)
        if contender.formula is not None:
            costmodel.coefficients(contender.formula, 4, 4096.0, **contender.params)
