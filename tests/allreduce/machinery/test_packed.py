"""Where the towers share one memory (logical CPUs), an all-reduce's identical outputs are
assembled once; every tower's output still waits for its own chunks."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce.machinery.packed import FUSE_BELOW, assemble
from towers.devices import canonical_device

# Every algorithm that cuts the value into chunks and puts each tower's output back together.
# (tree's default is one chunk, which needs no assembly: cut it in four.)
ASSEMBLED = ("ring", "swing", "bruck", "pat", "torus_2d", "halving_doubling", "tree",
             "double_binary_tree")
PARAMS = {"tree": {"chunks": 4}}


def _returned(run: tf.types.experimental.ConcreteFunction) -> list[tf.Tensor]:
    """What the traced body returned (tf.function adds an Identity per output)."""
    return [t.op.inputs[0] for t in run.graph.structured_outputs]


def _traced(name: str, n: int, size: int) -> tf.types.experimental.ConcreteFunction:
    devices = DEVICES[:n]
    algorithm = towers.ALGORITHMS[name](**PARAMS.get(name, {}))

    @tf.function
    def run(*values: tf.Tensor) -> list[tf.Tensor]:
        placed = []
        for v, d in zip(values, devices):
            with tf.device(d):
                placed.append(tf.identity(v))
        return algorithm(placed, op="sum")

    return run.get_concrete_function(*[tf.TensorSpec([size], tf.float32)] * n)


@pytest.mark.long
@pytest.mark.parametrize("name", ASSEMBLED)
def test_one_memory_writes_one_output_and_every_tower_gets_it(name: str) -> None:
    """One concat in the graph (n of them before: one per tower), outputs exact on their
    devices. 3 towers (odd; 4 in the test below), chunks above FUSE_BELOW (smaller ones
    are packed by gathers and concats of their own), and a size that leaves padding, cut
    back at the end."""
    n, size = 3, 8 * FUSE_BELOW + 1
    run = _traced(name, n, size)
    concats = [op for op in run.graph.get_operations() if op.type == "ConcatV2"]
    assert len(concats) == 1, [op.name for op in concats]
    rng = np.random.default_rng(n)
    values = [rng.integers(-64, 65, size).astype(np.float32) for _ in range(n)]
    outs = run(*values)
    want = np.sum(values, axis=0)
    devices = DEVICES[:n]
    for i, (out, traced) in enumerate(zip(outs, _returned(run))):
        np.testing.assert_array_equal(out.numpy(), want)
        # an eager output of a function lands on the caller's device: read the graph's
        assert canonical_device(traced.device) == canonical_device(devices[i])


@pytest.mark.parametrize("name", ["ring", "pat"])
def test_each_shared_output_waits_for_its_towers_own_chunks(name: str) -> None:
    """Tower i > 0 takes tower 0's assembly only after every chunk it holds has arrived: its
    output carries control inputs on its own device, so no send of the schedule is pruned."""
    n = 4
    run = _traced(name, n, 4096)
    outputs = _returned(run)
    devices = [canonical_device(d) for d in DEVICES[:n]]
    for i in range(1, n):
        op = outputs[i].op
        assert op.type == "Identity" and op.inputs[0].name == outputs[0].name
        waits = op.control_inputs
        assert waits, f"tower {i}'s output waits for nothing"
        assert {canonical_device(w.device) for w in waits} == {devices[i]}


def test_own_memories_assemble_on_every_tower() -> None:
    """Towers on two tasks (two memories) each build their own output."""
    devices = ["/job:worker/replica:0/task:0/device:CPU:0",
               "/job:worker/replica:0/task:1/device:CPU:0"]
    built: list[int] = []

    def build(tower: int) -> tf.Tensor:
        built.append(tower)
        return tf.constant([float(tower)])

    with tf.Graph().as_default():
        outs = assemble([[], []], devices, build)
        assert [op.type for op in (o.op for o in outs)] == ["Const", "Const"]
        assert [o.device for o in outs] == devices
    assert built == [0, 1]
