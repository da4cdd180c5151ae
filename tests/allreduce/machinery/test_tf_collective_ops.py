"""TensorFlow's collective-op plumbing: the one owner of keys and ordering tokens."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from tests.conftest import DEVICES
from towers.allreduce.machinery.tf_collective_ops import (
    KEY_START,
    SHARED_KEY_START,
    group_key,
    next_key,
    shared_keys,
    token,
)


def test_shared_keys_are_consecutive_blocks_apart_from_local_keys() -> None:
    first = shared_keys(3)
    second = shared_keys(2)
    assert first >= SHARED_KEY_START and second == first + 3
    local = next_key()  # drawing local keys (while tracing) leaves the shared range alone
    assert KEY_START <= local < SHARED_KEY_START
    assert shared_keys(1) == second + 2


def _local(out: list[int]) -> None:
    out.append(next_key())


def _shared(out: list[int]) -> None:
    first = shared_keys(2)
    out.extend([first, first + 1])


@pytest.mark.parametrize(("draw", "start"), [(_local, KEY_START), (_shared, SHARED_KEY_START)],
                         ids=["local", "shared"])  # fmt: skip
def test_keys_are_unique_across_threads(draw: Callable[[list[int]], None], start: int) -> None:
    found: list[list[int]] = [[] for _ in range(4)]

    def draws(out: list[int]) -> None:
        for _ in range(200):
            draw(out)

    threads = [threading.Thread(target=draws, args=(out,)) for out in found]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = [k for out in found for k in out]
    assert len(set(keys)) == len(keys) >= 800
    assert min(keys) >= start


def test_group_key_depends_on_the_device_set_only() -> None:
    a, b, c = DEVICES[:3]
    assert group_key([a, b]) == group_key([b, a])
    assert group_key([a, b]) != group_key([a, c])
    assert group_key([a, b]) >= KEY_START


def test_one_ordering_token_per_device_whatever_its_spelling() -> None:
    long_name = "/job:localhost/replica:0/task:0" + DEVICES[1]
    assert token(DEVICES[1]) is token(long_name)
    assert token(DEVICES[0]) is not token(DEVICES[1])
