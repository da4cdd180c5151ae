"""check_all_reduce passes correct algorithms and reports broken ones on a small example."""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given

from tests.conftest import DEVICES, examples
from towers.allreduce import Algorithm, naive, parameter_device, send
from towers.allreduce.machinery.base import check_values, combine, finish
from towers.testing.check import CheckReport, check_all_reduce, stratified
from towers.testing.values import Closeness, assert_close, tower_values, ulp_distance

# -- correct algorithms pass ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm",
    [naive, parameter_device(), parameter_device(DEVICES[7])],
    ids=["naive", "pd", "pd7"],
)
def test_correct_algorithms_pass(algorithm) -> None:
    report = check_all_reduce(algorithm, devices=DEVICES)
    assert report.ok, report
    assert report.examples >= 20 and report.failures == () and report.example is None
    assert str(report).startswith("PASS")


def test_registry_names_and_the_replay_check() -> None:
    report = check_all_reduce("naive", max_examples=examples(ci=6), replay=True)
    assert report.ok and bool(report), report
    assert "replay not checked" not in str(report)


def test_a_correct_byte_formula_passes() -> None:
    def counted(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        return naive(values, op=op)

    # naive: tower 0 broadcasts to n - 1 towers, every other tower sends its value once.
    def naive_bytes(n: int, nbytes: int, itemsize: int) -> list[int]:
        return [(n - 1) * nbytes] + [nbytes] * (n - 1)

    record = Algorithm("counted", lambda: counted, bytes_sent=naive_bytes)
    report = check_all_reduce(record(), max_examples=examples(ci=10))
    assert report.ok, report
    assert str(report).startswith("PASS: counted")
    assert "bytes not checked" not in str(report)


def test_a_plain_callable_is_checked_and_the_report_says_what_was_not() -> None:
    def plain(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        return naive(values, op=op)

    report = check_all_reduce(plain, max_examples=examples(ci=4))
    assert report.ok, report
    assert "bytes not checked: plain has no registry record" in str(report)
    assert "bound uses depth n-1" in str(report)


# -- broken algorithms are reported, not raised ----------------------------------------------


def _own_device(value: tf.Tensor) -> tf.Tensor:
    with tf.device(value.device):
        return tf.identity(value)


def last_tower_keeps_its_own(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """The d2l-style bug: the broadcast loop stops one tower short."""
    outs = naive(values, op=op)
    return [*outs[:-1], _own_device(values[-1])] if len(values) > 1 else outs


def everything_on_tower_zero(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    outs = naive(values, op=op)
    with tf.device(values[0].device):
        return [tf.identity(outs[0]) for _ in outs]


def each_tower_its_own_order(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Every tower sums starting from itself: within the bound, but replicas drift apart."""
    devices = check_values(values, op)
    outs = []
    for i, d in enumerate(devices):
        with tf.device(d):
            order = [send(values[(i + k) % len(values)], d) for k in range(len(values))]
            total = order[0]
            for v in order[1:]:
                total = combine(total, v, op)
            outs.append(finish(total, op, len(values)))
    return outs


def mean_forgets_to_divide(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    return naive(values, op="sum" if op == "mean" else op)


def _naive_again(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    return naive(values, op=op)


wrong_byte_formula = Algorithm(
    "wrong_byte_formula", lambda: _naive_again, bytes_sent=lambda n, nbytes, itemsize: [nbytes] * n
)()


def crashes_on_three(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    if len(values) == 3:
        raise RuntimeError("three towers are unlucky")
    return naive(values, op=op)


def wrong_when_empty(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Correct but for an empty tensor, where it hands back one element."""
    if values[0].shape.num_elements() == 0:
        devices = check_values(values, op)
        out = []
        for device in devices:
            with tf.device(device):
                out.append(tf.zeros([1], values[0].dtype))
        return out
    return naive(values, op=op)


def _failed(algorithm, **kwargs) -> CheckReport:
    report = check_all_reduce(algorithm, **kwargs)
    assert not report.ok and not bool(report)
    text = str(report)
    assert text.startswith("FAIL") and "Smallest failing example:" in text, text
    assert report.example and report.failures
    return report


def test_one_wrong_output_on_one_tower_is_caught_with_a_small_example() -> None:
    report = _failed(last_tower_keeps_its_own)
    assert report.example.startswith("n=2 towers, shape=()"), report
    assert any(f.startswith("output 1:") for f in report.failures), report
    assert not any(f.startswith("output 0:") for f in report.failures), report


def test_outputs_on_the_wrong_device_are_caught() -> None:
    report = _failed(everything_on_tower_zero)
    assert report.example.startswith("n=2 towers"), report
    assert "output 1 is on /device:CPU:0, but input 1 is on /device:CPU:1" in report.failures


@pytest.mark.long  # 10 s
def test_replicas_that_differ_in_the_last_bit_are_caught() -> None:
    report = _failed(each_tower_its_own_order, dtypes=["float32"], ops=["sum"])
    assert report.example.startswith("n=3 towers"), report
    assert any("not bitwise identical" in f and "ULP" in f for f in report.failures), report
    assert not any("[bound" in f for f in report.failures), report  # all within the bound


def test_a_wrong_value_is_caught_against_the_bound() -> None:
    report = _failed(mean_forgets_to_divide, ops=["mean"], dtypes=["float32"])
    assert "op='mean'" in report.example and report.example.startswith("n=2 towers")
    assert any("[bound" in f and "max abs error" in f for f in report.failures), report


def test_a_wrong_byte_count_is_caught() -> None:
    report = _failed(wrong_byte_formula)
    # [nbytes] * n is wrong from one tower on (one tower sends nothing), and a tower count
    # where nothing was sent is compared too
    assert report.example.startswith("n=1 towers"), report
    assert any(f.startswith("bytes sent per tower [") for f in report.failures), report


def test_an_exception_is_reported_not_raised() -> None:
    report = _failed(crashes_on_three, max_examples=examples(ci=30))
    assert report.example.startswith("n=3 towers"), report
    assert report.failures == ("raised RuntimeError: three towers are unlucky",)


def test_a_too_optimistic_summation_depth_is_caught() -> None:
    def claims_exact(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        return naive(values, op=op)

    record = Algorithm("claims_exact", lambda: claims_exact, summation_depth=lambda n: 0)
    report = _failed(record(), max_towers=3, dtypes=["float32"], ops=["sum"], shapes=[()])
    assert any("summation depth 0" in f for f in report.failures), report


def traced_differently(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Adds in tower order when eager, in reverse inside a graph: only replay=True sees it."""
    ordered = list(values) if tf.executing_eagerly() else list(values)[::-1]
    with tf.device(values[0].device):
        total = send(ordered[0], values[0].device)
        for v in ordered[1:]:
            total = combine(total, send(v, values[0].device), op)
        total = finish(total, op, len(values))
    return [send(total, v.device) for v in values]


def test_replay_check_catches_a_graph_that_adds_in_another_order() -> None:
    small = {"max_towers": 3, "dtypes": ["float32"], "ops": ["sum"], "shapes": [(), (3,)]}
    assert check_all_reduce(traced_differently, **small).ok
    report = _failed(traced_differently, replay=True, **small)
    assert report.example.startswith("n=3 towers"), report
    assert any("vs its NumPy replay" in f for f in report.failures), report


def test_tower_counts_can_be_chosen() -> None:
    report = check_all_reduce(naive, tower_counts=[2, 5], max_examples=4)
    assert report.ok and report.examples == 4, report
    with pytest.raises(ValueError, match="tower_counts"):
        check_all_reduce(naive, tower_counts=[0, 2])


def test_too_few_devices_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="simulate_devices"):
        check_all_reduce(naive, max_towers=9, devices=DEVICES)


# -- the comparison helpers ----------------------------------------------------------------------


def test_ulp_distance_counts_representable_values() -> None:
    one = np.float32(1)
    assert ulp_distance(np.nextafter(one, np.float32(2)), one) == 1
    assert ulp_distance(np.float32(-0.0), np.float32(0.0)) == 0
    assert ulp_distance(np.float32(-1e-45), np.float32(1e-45)) == 2  # across zero
    top = np.finfo(np.float64).max
    assert ulp_distance(-top, top) == 2 * 0x7FEFFFFFFFFFFFFF  # no int64 overflow
    assert ulp_distance(np.float32(np.inf), np.finfo(np.float32).max) == 1
    bf = np.array([1.0, 1.0078125], ml_dtypes.bfloat16)  # 1 + 2^-7 is the next bfloat16
    assert ulp_distance(bf[1], bf[0]) == 1
    assert ulp_distance(np.float16(1), np.float16(1) + np.float16(2**-10)) == 1
    assert ulp_distance(np.int64(2**62), np.int64(-(2**62))) == 2**63
    assert ulp_distance(np.float32(np.nan), np.float32(np.nan)) == 0
    assert ulp_distance(np.float32(np.nan), np.float32(1)) == np.iinfo(np.uint64).max


def test_assert_close_reports_abs_error_and_ulps() -> None:
    assert assert_close(np.float32(1.0000001), 1.0, ulps=1) == Closeness(2**-23, 1)
    assert assert_close([1.0, 2.0], [1.0, 2.0]) == Closeness(0.0, 0)
    with pytest.raises(
        AssertionError, match=r"grad: 1 of 3 elements differ; worst at index \(1,\)"
    ):
        assert_close(np.float32([1, 2, 3]), np.float32([1, 2.5, 3]), atol=0.1, what="grad")
    with pytest.raises(AssertionError, match=r"max abs error 0\.5, max 2097152 ULP"):
        assert_close(np.float32([2.5]), np.float64([2.0]))
    with pytest.raises(AssertionError, match="shape"):
        assert_close(np.zeros(2), np.zeros(3))
    assert_close(np.float32([1.0, np.nan]), [1.0, np.nan])  # NaNs in the same places
    assert_close(np.float32([100.0]), [101.0], rtol=0.01)


@given(tower_values(max_towers=8))
def test_tower_values_are_well_formed(case) -> None:
    n, arrays = case
    assert 1 <= n <= 8 and len(arrays) == n
    assert len({(a.shape, a.dtype) for a in arrays}) == 1
    total = np.sum(np.stack(arrays).astype(np.float64), axis=0)
    assert np.all(np.isfinite(total.astype(arrays[0].dtype)))  # sums cannot overflow


@given(tower_values(max_towers=3, dtypes=["bfloat16"], shapes=[(7,), (2, 5)]))
def test_tower_values_honour_dtypes_and_shapes(case) -> None:
    _, arrays = case
    assert arrays[0].dtype == np.dtype(ml_dtypes.bfloat16) and arrays[0].shape in [(7,), (2, 5)]


# -- a replay that cannot replay fails loudly ----------------------------------------------------


def sums_with_reduce_sum(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Correct, but through ``Sum`` (tf.reduce_sum), an op the NumPy replay has no kernel for."""
    devices = check_values(values, op)
    with tf.device(devices[0]):
        stacked = tf.stack([send(v, devices[0]) for v in values])
        total = finish(tf.reduce_sum(stacked, axis=0) if op in ("sum", "mean") else
                       (tf.reduce_max if op == "max" else tf.reduce_min)(stacked, axis=0), op,
                       len(values))
    return [send(total, d) for d in devices]


def test_a_record_that_is_not_replayable_fails_replay_with_the_reason() -> None:
    report = check_all_reduce("nccl", replay=True, max_towers=2, max_examples=2)
    assert not report.ok and report.examples == 0, report
    assert report.failures == (
        "replay impossible: nccl is not replayable (opaque collective ops: the runtime moves "
        "and adds the data)",
    )
    assert str(report).startswith("FAIL: nccl")


def test_a_graph_the_replay_cannot_follow_fails_replay_with_the_reason() -> None:
    small = {"max_towers": 2, "dtypes": ["float32"], "ops": ["sum"], "shapes": [(3,)]}
    assert check_all_reduce(sums_with_reduce_sum, **small).ok
    report = _failed(sums_with_reduce_sum, replay=True, **small)
    assert any(f.startswith("replay impossible:") and "Sum" in f for f in report.failures), report


def test_opaque_collectives_without_a_record_fail_replay_too() -> None:
    from towers.allreduce import nccl

    plain = nccl().run  # the bare callable: no record to say it is opaque
    report = _failed(plain, replay=True, max_towers=2, tower_counts=[2], max_examples=2,
                     dtypes=["float32"], ops=["sum"], shapes=[(3,)])
    refusals = [f for f in report.failures if f.startswith("replay impossible:")]
    assert refusals and "opaque" in refusals[0], report


def mean_by_a_power_of_two(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Planted bug: ``mean`` divides by the largest power of two <= n, so it is right for
    every op at n = 1, 2, 4, 8 and wrong only for ``mean`` at n = 3, 5, 6, 7."""
    if op != "mean":
        return naive(values, op=op)
    fold = 1 << (len(values).bit_length() - 1)
    out = []
    for total in naive(values, op="sum"):
        with tf.device(total.device):
            out.append(total / tf.cast(fold, total.dtype))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, None], ids=["seed0", "seed1", "seed2", "fresh"])
def test_every_tower_count_and_op_pair_is_drawn_so_a_mean_only_bug_is_always_caught(
    seed: int | None,
) -> None:
    report = check_all_reduce(mean_by_a_power_of_two, devices=DEVICES, seed=seed)
    assert not report.ok, report  # the default check: 8 tower counts, 4 ops, 20 examples
    assert report.example is not None and "n=3" in report.example and "mean" in report.example


def test_stratified_examples_cover_every_op_and_are_counted_in_a_note() -> None:
    cases = stratified(5, [tf.float16, tf.float32, tf.int32], ["sum", "mean", "max", "min"])
    assert [(c.n, c.op, c.arrays[0].dtype, c.arrays[0].shape) for c in cases] == [
        *((5, op, np.float32, (11,)) for op in ("sum", "mean", "max", "min")),
        (5, "sum", np.float32, ()), (5, "sum", np.float32, (0,))]
    assert [c.op for c in stratified(3, [tf.int64], ["sum", "mean"])] == ["sum"] * 3
    report = check_all_reduce("naive", max_towers=3, devices=DEVICES, max_examples=6)
    assert report.ok and (report.examples, report.stratified) == (6, 18), report
    assert ("note: plus 18 stratified examples: every (tower count, op) pair, and a scalar "
            "and an empty tensor") in str(report)


def _copies_without_send(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A correct star that moves data with tf.identity instead of send: nothing is counted."""
    devices = check_values(values, op)
    with tf.device(devices[-1]):
        total = tf.identity(values[0])
        for v in values[1:]:
            total = combine(total, tf.identity(v), op)
        total = finish(total, op, len(values))
    outs = []
    for d in devices:
        with tf.device(d):
            outs.append(tf.identity(total))
    return outs


def test_a_byte_formula_is_not_passed_when_nothing_was_sent_to_count() -> None:
    """A record's bytes_sent is a claim: with no send to count it is not verified, and the
    report says why (it used to pass, the claim never compared)."""
    record = Algorithm("copies_without_send", lambda: _copies_without_send,
                       bytes_sent=lambda n, nbytes, itemsize: [nbytes] * n,
                       summation_depth=lambda n: n - 1)  # fmt: skip
    report = _failed(record(), max_towers=3, dtypes=["float32"], ops=["sum"], shapes=[(3,)])
    assert any("nothing was sent with towers.allreduce.send" in f for f in report.failures)
    estimated = Algorithm("copies_estimated", lambda: _copies_without_send, estimated=True,
                          bytes_sent=lambda n, nbytes, itemsize: [nbytes] * n,
                          summation_depth=lambda n: n - 1)  # fmt: skip
    assert check_all_reduce(estimated(), max_towers=3, dtypes=["float32"], ops=["sum"]).ok


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ops": ["prod"]}, r"ops: unknown \['prod'\]"),
        ({"dtypes": [tf.int8]}, r"dtypes: \['int8'\] not supported"),
        ({"max_towers": 0}, "max_towers must be an int >= 1"),
        ({"max_towers": True}, "max_towers must be an int >= 1"),
    ],
)
def test_a_bad_option_is_the_callers_error_not_the_algorithms(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_all_reduce(naive, **kwargs)


def test_one_op_or_dtype_may_be_given_alone() -> None:
    report = check_all_reduce(naive, ops="sum", dtypes="float32", max_towers=3, max_examples=3)
    assert report.ok, report


def test_an_algorithm_wrong_only_for_an_empty_tensor_is_caught_at_the_defaults() -> None:
    # the random draw rarely gives (0,): every tower count also gets a scalar and an
    # empty tensor of its own (stratified)
    report = _failed(wrong_when_empty, devices=DEVICES)
    assert "float32[1]" in str(report) and "float32[0]" in str(report), report
