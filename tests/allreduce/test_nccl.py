"""Collective-op all-reduces (hint "nccl"): values, placement, keys, ordering tokens, timeouts.

A collective that times out, or an instance key reused with another shape, aborts
every later collective in the process, so the timeout test runs in a subprocess.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given
from tensorflow.python.ops import nccl_ops

from tests.allreduce.test_halving_doubling import Case, cases, check_all_reduce, make_values
from tests.conftest import DEVICES, GPUS, HAS_PROC, collective_threads
from towers.allreduce.nccl import (
    estimated_bytes_sent,
    nccl,
    nccl_ring,
    nccl_tree,
    raw_nccl_usable,
)
from towers.devices import has_gpu

module = importlib.import_module("towers.allreduce.nccl")
collective_ops_module = importlib.import_module("towers.allreduce.machinery.tf_collective_ops")

ALGORITHMS: dict[str, Callable[..., Any]] = {
    "nccl": nccl,
    "nccl_ring": nccl_ring,
    "nccl_tree": nccl_tree,
}
ROOT = Path(__file__).resolve().parents[2]


def _place(xs: list[tf.Tensor], devices: list[str]) -> list[tf.Tensor]:
    placed = []
    for x, device in zip(xs, devices, strict=True):
        with tf.device(device):
            placed.append(tf.identity(x))
    return placed


@pytest.mark.parametrize("name", list(ALGORITHMS))
@given(case=cases())
@example(case=Case(1, (), tf.float32, "mean", 0))
@example(case=Case(8, (0,), tf.float16, "sum", 1))
@example(case=Case(5, (13,), tf.bfloat16, "mean", 2))
@example(case=Case(3, (), tf.bfloat16, "max", 3))
@example(case=Case(7, (2, 3, 7), tf.int64, "sum", 4))
def test_every_output_matches_reduction(name: str, case: Case) -> None:
    algo = ALGORITHMS[name](timeout_seconds=30)
    values = make_values(case)
    outputs = algo(values, op=case.op)
    check_all_reduce(outputs, values, case.op, algo.summation_depth(case.n))


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_towers_in_any_device_order(name: str) -> None:
    # Collective ranks follow sorted device names, not tower order.
    devices = [DEVICES[5], DEVICES[2], DEVICES[7], DEVICES[0]]
    case = Case(4, (9,), tf.float32, "mean", 11)
    values = make_values(case, devices)
    algo = ALGORITHMS[name]()
    check_all_reduce(algo(values, op="mean"), values, "mean", algo.summation_depth(4))


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_nccl_ring_by_pairwise_broadcasts(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The construction nccl_ring uses above MAX_ALL_TO_ALL ranks, here at small counts:
    every op and dtype, towers in any device order, bitwise the all_to_all path."""
    devices = [DEVICES[i] for i in np.random.default_rng(n).permutation(8)[:n]]
    # Two timeouts: two eager caches, so the patched run traces its own graph.
    algo, by_pairs = nccl_ring(timeout_seconds=30), nccl_ring(timeout_seconds=31)
    for k, (dtype, op) in enumerate([(tf.float32, "mean"), (tf.bfloat16, "sum"),
                                     (tf.int32, "max"), (tf.float64, "min")]):
        values = make_values(Case(n, (3, 5), dtype, op, k), devices)
        direct = [o.numpy() for o in algo(values, op=op)]
        monkeypatch.setattr(collective_ops_module, "MAX_ALL_TO_ALL", 1)
        pairwise = by_pairs(values, op=op)
        monkeypatch.undo()
        check_all_reduce(pairwise, values, op, algo.summation_depth(n), devices=devices)
        for got, want in zip(pairwise, direct, strict=True):
            np.testing.assert_array_equal(got.numpy(), want)


def test_pairings_meet_every_pair_once_one_pair_per_tower_per_round() -> None:
    for n in range(1, 34):
        rounds = collective_ops_module._pairings(n)
        assert sorted(p for r in rounds for p in r) == [
            (a, b) for a in range(n) for b in range(a + 1, n)]
        for r in rounds:
            towers_in_round = [t for pair in r for t in pair]
            assert len(towers_in_round) == len(set(towers_in_round))
        assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_ranks_follow_tensorflow_device_indices() -> None:
    names = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (10, 2, 1, 0, 11)]
    assert collective_ops_module.ranks(names) == {names[3]: 0, names[2]: 1, names[1]: 2,
                                                  names[0]: 3, names[4]: 4}


def test_two_algorithms_and_shapes_in_one_tf_function() -> None:
    ring, tree, flat = nccl_ring(), nccl_tree(), nccl()
    devices = DEVICES[:4]

    @tf.function
    def step(a: tf.Tensor, b: tf.Tensor) -> list[tf.Tensor]:
        xs = _place([a * (i + 1) for i in range(4)], devices)
        ys = _place([b - i for i in range(4)], devices)
        r1, r2 = ring(xs), tree(ys, op="max")
        r3, r4 = flat(r1, op="mean"), ring(r2, op="min")
        return r1 + r2 + r3 + r4

    rng = np.random.default_rng(0)
    shapes = [((5,), (2, 3)), ((5,), (2, 3)), ((7,), ()), ((1,), (4, 1)), ((5,), (2, 3))]
    for shape_a, shape_b in shapes:  # retraces allocate fresh keys; repeats reuse theirs
        a = rng.integers(-50, 50, shape_a).astype(np.float32)  # exact sums
        b = rng.integers(-50, 50, shape_b).astype(np.float32)
        outs = [o.numpy() for o in step(tf.constant(a), tf.constant(b))]
        # sum of a·(i+1), max of b − i, mean of equal sums, min of equal maxima
        wants = [a * 10] * 4 + [b] * 4 + [a * 10] * 4 + [b] * 4
        for got, want in zip(outs, wants, strict=True):
            np.testing.assert_array_equal(got, want)


def test_several_eager_calls_in_a_row() -> None:
    algos = [nccl(), nccl_ring(), nccl_tree()]
    for k, shape in enumerate([(6,), (6,), (3, 2), (6,), (), (11,)]):
        for algo in algos:
            case = Case(3, shape, tf.float64, "sum", k)
            values = make_values(case)
            check_all_reduce(algo(values), values, "sum", algo.summation_depth(3))


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_collective_has_no_op_timeout_a_hint_and_a_token(name: str) -> None:
    # an op's own timeout holds a thread for its whole length (the module docstring of
    # tf_collective_ops): the deadline is the call's or the step's, never the op's
    for algo in (ALGORITHMS[name](timeout_seconds=7.5), ALGORITHMS[name]()):
        fn = tf.function(lambda *xs, algo=algo: algo(_place(list(xs), DEVICES[:3])))
        graph = fn.get_concrete_function(*[tf.TensorSpec([6], tf.float32)] * 3).graph
        ops = [op for op in graph.get_operations() if op.type.startswith("Collective")]
        assert ops
        for op in ops:
            assert op.get_attr("timeout_seconds") == 0, op.name
            assert op.get_attr("communication_hint") == b"nccl", op.name
            if op.type in ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2"):
                assert op.get_attr("Nordering_token") == 1, op.name


@pytest.mark.skipif(not HAS_PROC, reason="counts the process's threads in Linux's /proc")
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_calls_leave_no_thread_behind(name: str) -> None:
    algo = ALGORITHMS[name]()
    values = _place([tf.ones([6])] * 8, DEVICES[:8])
    algo(values)
    first = collective_threads()
    for _ in range(20):
        algo(values)
    # with an op timeout every call left 2 threads per tower asleep for 60 s: +320 here;
    # without, the pool is the most collectives ever blocked at once (≤ 2 per tower)
    assert collective_threads() <= max(first, 4 * 8)


_TIMEOUT_SCRIPT = """
import sys, time
import tensorflow as tf
import towers
devices = towers.simulate_devices(3)
import importlib
m = importlib.import_module("towers.allreduce.nccl")
from towers.allreduce.machinery.tf_collective_ops import run
from towers.guard.deadline import watched
values = []
for d in devices[:2]:
    with tf.device(d):
        values.append(tf.ones([4]))
start = time.time()
try:  # a group of 3 with only 2 towers launched: tower 2 is the missing peer
    if sys.argv[1] == "eager":  # an eager call of the algorithm: its own deadline
        run(lambda vals, devs, op: m._all_reduce_ops(vals, devs, op, 3), values, "sum", 2.0)
    else:  # the user's own tf.function, bounded as docs/reliability.md shows
        step = tf.function(lambda: m._all_reduce_ops(values, devices[:2], "sum", 3))
        with watched(2.0, "towers: my step did not complete within 2 s"):
            step()
    print("NO ERROR")
except tf.errors.DeadlineExceededError as err:
    print("DeadlineExceededError after %.1f s:" % (time.time() - start), str(err).strip()[-200:])
"""


@pytest.mark.long
def test_missing_peer_times_out_instead_of_hanging() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    script = textwrap.dedent(_TIMEOUT_SCRIPT)
    procs = {mode: subprocess.Popen([sys.executable, "-c", script, mode], env=env, cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in ("eager", "function")}  # fmt: skip
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=120)  # a hang fails the test, never the suite
        assert "DeadlineExceededError" in out, out + err[-2000:]
        who = "a collective" if mode == "eager" else "my step"
        assert f"towers: {who} did not complete within 2 s" in out, out


@pytest.mark.skipif(has_gpu(), reason="checks the CPU-only behaviour")
def test_raw_nccl_has_no_cpu_kernel() -> None:
    assert not raw_nccl_usable(DEVICES[:2], tf.float32)
    values = make_values(Case(2, (3,), tf.float32, "sum", 0))
    match = "No OpKernel was registered to support Op 'NcclAllReduce'"
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        nccl_ops.all_sum(values)


@pytest.mark.skipif(
    len(GPUS) < 2,
    reason=f"needs 2+ physical GPUs, found {len(GPUS)}: NcclAllReduce has no CPU kernel "
    "('No OpKernel was registered to support Op NcclAllReduce') and NCCL takes one rank "
    "per physical GPU",
)
def test_raw_nccl_path_on_gpus() -> None:
    # conftest splits the CPU only, so GPUS are whole physical GPUs: the raw path is taken.
    assert raw_nccl_usable(GPUS, tf.float32), GPUS
    for op in ("sum", "mean", "max", "min"):
        values = make_values(Case(len(GPUS), (5, 3), tf.float32, op, 1), GPUS)
        check_all_reduce(nccl()(values, op=op), values, op, len(GPUS) - 1, devices=GPUS)


@pytest.mark.skipif(not GPUS, reason="needs a physical GPU: checks collective ops on GPUs")
def test_collective_ops_with_the_nccl_hint_on_gpus() -> None:
    # The collective path (not raw NCCL) on the real GPUs: all_reduce_v2 with hint "nccl"
    # is NCCL's own reducer there, whatever the GPU count (a group of one included).
    n = len(GPUS)
    for op in ("sum", "mean", "max"):
        values = make_values(Case(n, (4, 3), tf.float32, op, 2), GPUS)
        outputs = tf.function(
            lambda *xs, op=op: module._all_reduce_ops(list(xs), GPUS, op, 30.0, n)
        )(*values)
        check_all_reduce(list(outputs), values, op, n - 1, devices=GPUS)
    for algo in (nccl_ring(timeout_seconds=30), nccl_tree(timeout_seconds=30)):
        values = make_values(Case(n, (7,), tf.float32, "sum", 3), GPUS)
        check_all_reduce(algo(values), values, "sum", algo.summation_depth(n), devices=GPUS)


def test_estimated_bytes_sent() -> None:
    assert estimated_bytes_sent(1, 100) == [0.0]
    assert estimated_bytes_sent(4, 1000) == [1500.0] * 4
    with pytest.raises(ValueError):
        estimated_bytes_sent(0, 4)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_timeout_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError, match="timeout_seconds must be positive"):
        ALGORITHMS[name](timeout_seconds=0)


@pytest.mark.parametrize("name", ["nccl", "nccl_ring", "nccl_tree"])
def test_using_only_one_output_does_not_hang(name: str) -> None:
    """The parameter-device placement keeps output 0 only: the rest must still run."""
    algorithm = ALGORITHMS[name](timeout_seconds=10)

    @tf.function(autograph=False)
    def first(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        values, doubled = [], []
        for i, d in enumerate(DEVICES[:4]):
            with tf.device(d):
                values.append(tf.identity(a if i % 2 else b))
                doubled.append(values[-1] * 2.0)
        return algorithm(values)[0] + algorithm(doubled)[0]

    out = first(tf.ones([5]), tf.zeros([5]))
    np.testing.assert_array_equal(out.numpy(), np.full(5, 6.0, np.float32))
