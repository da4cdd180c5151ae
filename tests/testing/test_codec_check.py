"""check_codec: every built-in codec passes; planted bugs fail, each with a clear message.

The planted codecs are small subclasses or wrappers of the built-ins, each breaking one
promise of the contract (towers.allreduce.codecs.Codec).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers.allreduce import CODECS
from towers.allreduce.codecs import Cast, Identity, TopK, TopKState, Wire
from towers.testing import check_codec

FAST = {"tower_counts": (1, 3), "shapes": ((5,), (8, 6)), "trainer": False, "devices": DEVICES}


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_built_in_codec_passes(name: str) -> None:
    report = check_codec(name, devices=DEVICES)
    assert report.ok, report
    assert not any("not checked" in note for note in report.notes), report


@dataclasses.dataclass(frozen=True)
class Forgetful(TopK):
    """Drops what it does not send: the residual is never kept."""

    def encode(self, tensor: tf.Tensor, state: TopKState) -> Any:
        payload, _ = super().encode(tensor, state)
        return payload, TopKState(tf.zeros_like(tensor))


@dataclasses.dataclass(frozen=True)
class Noisy(Identity):
    """Each tower decodes its own copy and tower t adds t·1e-3: the replicas drift."""

    def reduce(self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire) -> Any:
        reduced = wire.all_reduce(tensors)
        return [r + 1e-3 * t for t, r in enumerate(reduced)], list(states)


@dataclasses.dataclass(frozen=True)
class Homeless(Identity):
    """Leaves every output on tower 0."""

    def reduce(self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire) -> Any:
        reduced = wire.all_reduce(tensors)
        return [reduced[0]] * len(tensors), list(states)


@dataclasses.dataclass(frozen=True)
class Boastful(Cast):
    """Claims a quarter of what it sends."""

    def payload_bytes(self, shape: tf.TensorShape, dtype: tf.DType) -> int:
        return super().payload_bytes(shape, dtype) // 2


@dataclasses.dataclass(frozen=True)
class Widening(TopK):
    """Returns its residual in float64: the state's dtype changes."""

    def encode(self, tensor: tf.Tensor, state: TopKState) -> Any:
        payload, new = super().encode(tensor, state)
        return payload, TopKState(tf.cast(new.residual, tf.float64))


@dataclasses.dataclass(frozen=True)
class OwnOrder(Identity):
    """Each decoding tower adds the towers' parts starting from its own: the same sum in
    exact arithmetic, another rounding per tower (seen only when every tower decodes)."""

    def reduce(self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire) -> Any:
        def decode(t: int) -> tf.Tensor:
            parts = wire.gather(tensors, t)
            parts = parts[t:] + parts[:t]
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return total

        return wire.decode(decode), list(states)


@pytest.mark.parametrize(("codec", "message"), [
    (Forgetful(0.25), r"error feedback broken at element .*bound"),
    (Noisy(), r"outputs of towers \[1, 2\] differ from tower 0's"),
    (Homeless(), r"output 1 is on .*, not tower 1's"),
    (Boastful(tf.float16), r"handed the wire 10 bytes; payload_bytes\(5,\) says 5"),
    (Widening(0.5), r"state changed structure: .*float32.* -> .*float64"),
    (OwnOrder(), r"decode='everywhere': outputs of towers \[.*\] differ from tower 0's"),
], ids=["forgets-residual", "replicas-differ", "wrong-device", "wrong-bytes", "state-dtype",
        "decode-depends-on-tower"])
def test_a_planted_bug_fails_with_a_clear_message(codec: Any, message: str) -> None:
    report = check_codec(codec, **FAST)
    assert not report.ok
    assert any(re.search(message, f) for f in report.failures), report


class Counting(Identity):
    """Counts its steps in a variable of its own, outside init's state: not checkpointed."""

    def __init__(self) -> None:
        self.steps = tf.Variable(0, name="codec_steps")

    def reduce(self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire) -> Any:
        self.steps.assign_add(1)
        return super().reduce(tensors, states, wire)


def test_state_kept_outside_init_fails_the_checkpoint_round_trip() -> None:
    report = check_codec(Counting(), tower_counts=(2,), shapes=((3,),), devices=DEVICES)
    assert not report.ok
    assert report.failures == ("checkpoint: the state restored differs from the state saved "
                               "(state kept outside init's tuple is not checkpointed)",), report


def test_a_codec_without_formulas_is_checked_and_says_what_it_could_not() -> None:
    class Bare:
        def init(self, shape: Any, dtype: Any, key: int) -> tuple[()]:
            return ()

        def reduce(self, tensors: Sequence[tf.Tensor], states: Sequence[Any], wire: Wire) -> Any:
            reduced = wire.all_reduce(tensors)
            return wire.decode(lambda t: reduced[t]), list(states)

    report = check_codec(Bare(), **FAST)
    assert report.ok, report
    assert any("bytes not checked" in n for n in report.notes), report
