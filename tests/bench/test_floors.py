"""The floor of a chunked all-reduce: its chunk additions and its assembly."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tests.conftest import DEVICES
from towers.bench import allreduce as bench
from towers.bench import floors


def test_the_floor_parts_are_chunked_work_and_the_chunked_rows_are_marked() -> None:
    chunked = {c.name for c in bench.contenders(DEVICES[:3]) if c.chunked}
    assert chunked == {"ring", "swing", "bruck", "pat", "torus_2d", "halving_doubling"}
    values = []
    for i, d in enumerate(DEVICES[:3]):
        with tf.device(d):
            values.append(tf.constant(np.arange(7, dtype="float32") + 10 * i))
    adds = floors.chunk_adds(values)
    assert len(adds) == 3 * 2 and all(a.shape == (1, 3) for a in adds)  # ⌈7/3⌉ = 3
    assert np.array_equal(adds[0].numpy(), [[20.0, 22.0, 24.0]])  # tower 2's chunk 0 + tower 0's
    outs = floors.assembly(values)
    assert [o.shape for o in outs] == [(3, 3)] * 3
    for o in outs[1:]:  # one memory: the towers share one write, as the schedules do
        assert np.array_equal(o.numpy(), outs[0].numpy())
    assert np.array_equal(outs[1].numpy().reshape(-1)[:7],
                          [0, 1, 2, 13, 14, 15, 26])  # chunk c from tower c
