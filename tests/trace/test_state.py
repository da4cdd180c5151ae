"""Chunk state per tick (towers.trace.state), its topology and its picture.

The state is computed from the data each send carries (labelled inputs), so these
tests hold every registered algorithm to the same claims at n = 1 … 8: before the
first tick every tower holds only its own contribution; after the last tick every
chunk of every tower holds all n; the end state equals what the outputs hold; and
the α messages counted on the trace equal the record's cost formula.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers.allreduce import ALGORITHMS, check_values, combine, send
from towers.trace.draw import draw_state
from towers.trace.state import default_size, sends_by_tick, topology, trace_state

NAMES = sorted(ALGORITHMS)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_every_chunk_holds_every_contribution_after_the_last_tick(name: str) -> None:
    for n in range(1, 9):
        state = trace_state(name, DEVICES[:n])
        assert state.states[0] == tuple((frozenset({p}),) * len(state.segments)
                                        for p in range(n)), (name, n)
        assert state.complete(), (name, n, state.states[-1])
        assert state.states[-1] == state.outputs, (name, n)
        assert sum(b - a for a, b in state.segments) == default_size(n)
        if state.observed and state.alpha is not None:
            assert state.messages == state.alpha, (name, n, state.messages, state.alpha)


def test_ring_reduce_scatter_leaves_one_complete_chunk_per_tower() -> None:
    state = trace_state("ring", DEVICES[:4])
    middle = state.states[3]  # after tick 2 = n - 2: the reduce-scatter is over
    everyone = frozenset(range(4))
    assert [sum(held == everyone for held in tower) for tower in middle] == [1, 1, 1, 1]
    assert len(state.segments) == 4 and state.ticks == 6


def test_halving_doubling_sends_halves_then_quarters() -> None:
    state = trace_state("halving_doubling", DEVICES[:8])
    sends = sends_by_tick(state)
    widths = {t: {sum(b - a for a, b in r) for (tick, _, _), r in sends.items() if tick == t}
              for t in range(3)}
    assert widths == {0: {32}, 1: {16}, 2: {8}}  # 64 elements: the halving, drawn
    assert topology(state).kind == "butterfly"


@pytest.mark.parametrize(("name", "n", "kind"), [
    ("ring", 5, "ring"), ("tree", 7, "tree"), ("torus_2d", 6, "torus 2×3"),
    ("nccl", 4, "collective"), ("halving_doubling", 4, "butterfly"),
], ids=["ring", "tree", "torus_2d", "nccl", "halving_doubling"])
def test_topology_is_read_off_the_links(name: str, n: int, kind: str) -> None:
    assert topology(trace_state(name, DEVICES[:n])).kind == kind


def _forgetful(values: list[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Naive all-reduce that forgets the last tower's contribution."""
    devices = check_values(values, op)
    with tf.device(devices[0]):
        total = values[0]
        for v in values[1:-1]:
            total = combine(total, send(v, devices[0], tick=0), op)
    return [send(total, d, tick=1) for d in devices]


def test_a_forgotten_contribution_shows_in_the_state() -> None:
    state = trace_state(_forgetful, DEVICES[:3])
    assert not state.complete()
    assert state.states[-1][1] == (frozenset({0, 1}),)
    # Tower 2 kept its own part under the state's "a receiver combines" rule, but its
    # output was overwritten by the broadcast: the decoded outputs tell the truth.
    assert state.outputs == ((frozenset({0, 1}),),) * 3
    assert state.states[-1] != state.outputs


def test_a_send_that_is_no_sum_of_contributions_is_refused() -> None:
    def doubled(values: list[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        devices = check_values(values, op)
        return [send(values[0] * 3.0, d) for d in devices]

    with pytest.raises(ValueError, match="no sum of labelled contributions"):
        trace_state(doubled, DEVICES[:2])


def test_too_many_towers_is_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="devices"):
        trace_state("ring", [DEVICES[0]] * 25)


# One render per algorithm, the tower counts cycling through 1 … 8 (renders cost ~0.3 s
# each on CI; the state itself is checked at every n above).
@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_every_algorithm_draws_its_state(name: str, tmp_path: Path) -> None:
    n = 1 + NAMES.index(name) % 8
    path = draw_state(trace_state(name, DEVICES[:n]), tmp_path / "state.png", dpi=40)
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 1000
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and np.ptp(pixels[..., :3]) > 0.5  # something drawn, in colour
