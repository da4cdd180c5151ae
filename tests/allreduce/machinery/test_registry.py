"""Every registered algorithm keeps every promise of the contract (properties 1–5).

``check_all_reduce`` draws tower counts 1–8, shapes ((), (0,), primes, sizes no tower
count divides), every dtype and op, and checks each output: the value against the
exact sum within the summation-depth bound, its device, bitwise agreement between
towers, the bytes counted at ``send`` against the module's formula, and — for the
hand-built algorithms — bitwise equality with the NumPy replay of the traced graph.
TensorFlow's collectives are opaque to the replay (the runtime picks their order).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES, examples
from towers.allreduce import ALGORITHMS, Algorithm, Configured, register
from towers.allreduce.machinery.registry import record_of, schedule_of
from towers.testing import check_all_reduce

OPAQUE = {"nccl", "nccl_ring", "nccl_tree"}


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_registered_algorithm_keeps_the_contract_at_every_tower_count(name: str, n: int) -> None:
    """Value, placement, agreement, bytes against the record and (hand-built ones) replay."""
    report = check_all_reduce(
        name, max_examples=examples(ci=2), replay=ALGORITHMS[name].replayable, tower_counts=[n],
        devices=DEVICES,
    )
    assert report.ok, str(report)
    assert report.examples == examples(ci=2)
    if name not in OPAQUE:  # every property was checked: no note says otherwise
        assert report.notes == (), report


def test_every_record_is_complete() -> None:
    for name, record in ALGORITHMS.items():
        assert record.name == name and record.schedule, name
        assert record.bytes_sent and record.summation_depth and record.cost, name
        assert record.replayable == (name not in OPAQUE) and record.estimated == (name in OPAQUE)
        built = record()
        assert isinstance(built, Configured) and record_of(built) is built
        assert built.algorithm is record and built.name == name
        for n in range(1, 9):
            assert built.summation_depth(n) <= max(n - 1, 0)
            assert len(built.bytes_sent(n, 64, 4) or []) == n


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_cost_is_defined_at_every_tower_count(name: str) -> None:
    """The α-β-γ coefficients exist for every count a user can pass, are never negative,
    and are zero for one tower (nothing moves, nothing is added)."""
    cost = ALGORITHMS[name].cost
    assert tuple(cost(1, 4096.0)) == (0.0, 0.0, 0.0), name
    for n in (*range(2, 9), 12, 16):
        coefficients = tuple(cost(n, 4096.0))
        assert len(coefficients) == 3 and all(np.isfinite(c) and c >= 0 for c in coefficients)
        assert coefficients[0] > 0, (name, n)  # at least one message


def test_configured_algorithms_know_their_params() -> None:
    from towers.allreduce import hierarchical, parameter_device, ring, tree

    algo = ring(subchunks=2)
    assert algo.params == {"subchunks": 2} and algo.subchunks == 2
    assert algo.bytes_sent(4, 64, 4) == [96] * 4 and algo.summation_depth(4) == 3
    assert ALGORITHMS["ring"](3).params == {"subchunks": 3}
    assert tree(chunks=4).params == {"chunks": 4} and repr(tree(chunks=4)) == "tree(chunks=4)"
    assert parameter_device(DEVICES[7]).bytes_sent(4, 8, 4) is None  # unknown off tower 0
    assert dict(hierarchical().params) == {"inner": "naive", "outer": "ring", "group_size": 2}
    with pytest.raises(AttributeError):
        _ = algo.chunks
    with pytest.raises(ValueError, match="subchunks"):
        ring(subchunks=0)


def test_a_users_algorithm_registers_with_one_line() -> None:
    def star(values, *, op="sum"):  # type: ignore[no-untyped-def]
        return towers.allreduce.naive(values, op=op)

    record = register(Algorithm(
        "test_star", lambda: star, bytes_sent=lambda n, nbytes, itemsize: [(n - 1) * nbytes]
        + [nbytes] * (n - 1), summation_depth=lambda n: max(n - 1, 0), schedule="star"))
    try:
        assert ALGORITHMS["test_star"] is record
        report = check_all_reduce("test_star", max_examples=4, max_towers=3, devices=DEVICES)
        assert report.ok and "bytes not checked" not in str(report), report
        assert towers.allreduce.get("test_star").run is star
    finally:
        del ALGORITHMS["test_star"]


def test_schedule_of_takes_the_first_drawn_block() -> None:
    doc = "Title.\n\nText::\n\n    a  b\n      c\n\nAfter.\n"
    assert schedule_of(doc) == "a  b\n  c"
    assert schedule_of("no drawing") == ""


def test_unknown_names_list_the_registry() -> None:
    with tf.device(DEVICES[0]):
        x = tf.ones([2])
    with pytest.raises(ValueError, match=r"registered: .*ring"):
        towers.all_reduce([x], algorithm="butterfly")


def test_every_registered_factory_builds_with_defaults() -> None:
    for name, factory in ALGORITHMS.items():
        assert callable(factory()), name
        assert towers.ALGORITHMS[name] is factory


def test_naive_chains_large_buffers_with_the_same_bits() -> None:
    """Above 16 MB naive adds pairwise instead of with AddN: same order, same bits."""
    from towers.allreduce import naive
    from towers.testing.replay import replay

    rng = np.random.default_rng(0)
    n, size = 3, 5 * 2**20  # 20 MB of float32 per tower
    arrays = [rng.normal(size=size).astype(np.float32) for _ in range(n)]
    values = []
    for a, d in zip(arrays, DEVICES[:n]):
        with tf.device(d):
            values.append(tf.constant(a))
    out = towers.all_reduce(values, algorithm="naive")
    sequential = (arrays[0] + arrays[1]) + arrays[2]
    for o in out:
        np.testing.assert_array_equal(o.numpy(), sequential)
    np.testing.assert_array_equal(replay(naive, arrays, devices=DEVICES[:n])[0], sequential)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_bad_input_is_named(name: str) -> None:
    """The contract's checks, for every algorithm: empty, shapes (naming the towers), one
    device twice, an unknown op, an integer mean."""
    algo = ALGORITHMS[name]()
    with pytest.raises(ValueError, match="values is empty"):
        algo([])
    values = []
    for d, shape in zip(DEVICES[:3], [[3], [3], [4]]):
        with tf.device(d):
            values.append(tf.zeros(shape))
    with pytest.raises(ValueError, match=r"tower 0 has \(3,\), tower 2 \(4,\)"):
        algo(values)
    with pytest.raises(ValueError, match="both on"):
        algo([values[0], values[0]])
    with pytest.raises(ValueError, match="op must be one of"):
        algo(values[:2], op="prod")
    ints = []
    for d in DEVICES[:2]:
        with tf.device(d):
            ints.append(tf.zeros([2], tf.int32))
    with pytest.raises(ValueError, match="not defined for integer"):
        algo(ints, op="mean")


def test_every_registry_holds_one_record_shape() -> None:
    from towers.allreduce import CODECS, COLLECTIVE_ALGORITHMS, Record, Registry
    from towers.allreduce.codecs import Cast
    from towers.allreduce.powersgd import PowerSGD
    from towers.placement import PLACEMENTS, Sharded

    registries = {"all_reduce": ALGORITHMS, "codec": CODECS, "placement": PLACEMENTS}
    for kind, registry in registries.items():
        assert isinstance(registry, Registry) and registry.kinds == (kind,)
        for name, record in registry.items():
            assert isinstance(record, Record) and (record.name, record.kind) == (name, kind)
    for (collective, name), record in COLLECTIVE_ALGORITHMS.items():
        assert isinstance(record, Record) and (record.kind, record.name) == (collective, name)
        assert record.generator is not None and record.generator(3).collective == collective
    # codecs are registered in one place, powersgd included; a record builds its thing
    assert sorted(CODECS) == ["bf16", "fp16", "identity", "powersgd", "topk"]
    assert isinstance(CODECS["fp16"](), Cast) and isinstance(CODECS["powersgd"](2), PowerSGD)
    assert sorted(PLACEMENTS) == ["parameter_device", "replicated", "sharded"]
    first, second = PLACEMENTS["sharded"](), PLACEMENTS["sharded"]()
    assert isinstance(first, Sharded) and first is not second  # a plan per trainer
    with pytest.raises(TypeError, match="codec records"):
        CODECS.register(ALGORITHMS["ring"])
    with pytest.raises(ValueError, match="kind must be one of"):
        Record("x", lambda: None, kind="nonsense")


SCHEDULED = ["bruck", "double_binary_tree", "halving_doubling", "pat", "ring", "swing",
             "torus_2d", "tree"]
PORT_COST = ("double_binary_tree", "tree")
"""Their cost is the cost model's single-port count (a parent takes its children's
pieces one after the other), in closed form; the others' is their schedule's."""


@pytest.mark.parametrize("name", SCHEDULED)
def test_a_schedules_record_derives_its_numbers_from_the_generator(name: str) -> None:
    from towers.allreduce.machinery.registry import from_schedule
    from towers.allreduce.machinery.scheduled import generator_of
    from towers.schedule import summation_depth

    record = ALGORITHMS[name]
    assert record.generator is not None and generator_of(record()) is not None
    derived = from_schedule(record.generator)
    for n in range(1, 17):
        schedule = record.generator(n)
        assert schedule.towers == n and schedule.collective == "all_reduce"
        assert generator_of(record())(n) == schedule  # the algorithm runs this schedule
        assert record.summation_depth(n) == summation_depth(schedule) == derived[
            "summation_depth"](n)
        for nbytes in (0, 4, 40, 4 * (3 * n + 1)):
            assert record.bytes_sent(n, nbytes, 4) == derived["bytes_sent"](n, nbytes, 4)
        if name not in PORT_COST:
            assert record.cost(n, 1000.0) == pytest.approx(derived["cost"](n, 1000.0)), n
    assert sorted(k for k, r in ALGORITHMS.items() if r.generator is not None) == SCHEDULED
