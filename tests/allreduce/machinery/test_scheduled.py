"""The schedule interpreter packs a tick's chunks per (src, dst): the traced graph grows with
the schedule's messages, not with its chunk steps."""

from __future__ import annotations

import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce.machinery.packed import FUSE_BELOW
from towers.schedule import Schedule

CHUNKED = ("ring", "swing", "bruck", "pat", "torus_2d", "halving_doubling")


def op_count(name: str, n: int, size: int = 1000) -> int:
    """Ops in the traced all-reduce (``name``) of one ``size``-element value per tower."""
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]

    def run(*xs: tf.Tensor) -> list[tf.Tensor]:
        values = []
        for x, device in zip(xs, devices):
            with tf.device(device):
                values.append(tf.identity(x))
        return towers.all_reduce(values, algorithm=name)

    specs = [tf.TensorSpec([size], tf.float32)] * n
    return len(tf.function(run).get_concrete_function(*specs).graph.get_operations())


def messages(schedule: Schedule) -> int:
    """The schedule's messages: distinct (tick, src, dst)."""
    return sum(len({(s.src, s.dst) for s in tick}) for tick in schedule.ticks)


def steps(schedule: Schedule) -> int:
    return sum(len(tick) for tick in schedule.ticks)


def _schedule(name: str, n: int) -> Schedule:
    generator = towers.ALGORITHMS[name].generator
    assert generator is not None
    return generator(n)


@pytest.mark.long
@pytest.mark.parametrize("name", CHUNKED)
def test_op_count_grows_with_messages_not_chunk_steps(name: str) -> None:
    """From 8 to 16 towers the op count grows no faster than the messages do (30 % slack for
    the per-tower cut and assembly); a graph with ops per chunk step grows like the steps,
    2n(n − 1): faster than the messages of every schedule here but ring's (measured: 3.84×
    for each of them chunk by chunk, against 2.67× more messages for swing, pat, bruck)."""
    small, large = (_schedule(name, n) for n in (8, 16))
    grow = op_count(name, 16) / op_count(name, 8)
    assert grow <= 1.3 * messages(large) / messages(small), (name, grow)
    if messages(large) < steps(large):  # messages carry several chunks: packing shows
        assert grow < steps(large) / steps(small), (name, grow)


@pytest.mark.parametrize("name", ["halving_doubling", "swing"])
def test_small_chunks_travel_together_and_large_ones_alone(name: str) -> None:
    """One add per message of small chunks, one per chunk step above FUSE_BELOW (fusing
    large chunks lengthens a tick's ops: measured slower at 16 and 64 MB per tower)."""
    n = 4
    schedule = _schedule(name, n)
    reduces = [tick for tick in schedule.ticks if tick[0].kind == "reduce"]
    fused = sum(len({(s.src, s.dst) for s in tick}) for tick in reduces)
    alone = sum(len(tick) for tick in reduces)
    assert fused < alone
    algorithm = towers.ALGORITHMS[name]()
    for size, adds in ((64, fused), (n * FUSE_BELOW // 4 * 2, alone)):
        def run(*xs: tf.Tensor) -> list[tf.Tensor]:
            placed = []
            for x, d in zip(xs, DEVICES[:n]):
                with tf.device(d):
                    placed.append(tf.identity(x))
            return algorithm(placed, op="sum")

        graph = tf.function(run).get_concrete_function(
            *[tf.TensorSpec([size], tf.float32)] * n).graph
        assert sum(op.type == "AddV2" for op in graph.get_operations()) == adds, size
