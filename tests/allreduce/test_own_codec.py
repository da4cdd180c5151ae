'''docs/codecs.md "Write your own codec": its two blocks, run as printed.

``CODEC`` is ``my_codecs.py`` and ``USAGE`` the code that checks, registers and trains with
it, character for character as docs/codecs.md gives them: its blocks must equal these (an
edit on either side that breaks the other fails here). The only change made to run them in
this process: the 8 devices conftest simulated are already there, so
``simulate_devices(4)`` takes the first 4 of them.
'''

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "codecs.md"

CODEC = '''\
import dataclasses
from typing import NamedTuple

import tensorflow as tf

from towers.allreduce.machinery.rounding import rounding


class Int8State(NamedTuple):
    residual: tf.Tensor  # what this tower has not sent yet (error feedback)


@dataclasses.dataclass(frozen=True)
class Int8:
    """Send g + residual as int8 steps of one float32 scale per tower; feed the rest back."""

    def init(self, shape, dtype, key):
        return Int8State(tf.zeros(shape, dtype))

    def encode(self, tensor, state):
        delta = tensor + state.residual
        scale = tf.reduce_max(tf.abs(delta)) / 127
        q = tf.cast(tf.round(tf.math.divide_no_nan(delta, scale)), tf.int8)
        return q, scale, Int8State(delta - tf.cast(q, delta.dtype) * scale)

    def reduce(self, tensors, states, wire):
        encoded = wire.per_tower(lambda t: self.encode(tensors[t], states[t]))
        qs, scales = [e[0] for e in encoded], [e[1] for e in encoded]

        def decode(t):  # on the decoder tower t: add every tower's part, in tower order
            total = tf.zeros_like(tensors[t])
            for q, scale in zip(wire.gather(qs, t), wire.gather(scales, t)):
                total += tf.cast(q, total.dtype) * scale
            return total

        return wire.decode(decode), [e[2] for e in encoded]

    def payload_bytes(self, shape, dtype):  # one byte per element and the scale
        return shape.num_elements() + 4

    def error_bound(self, abs_sum, towers, depth):  # each part is at most max|delta|
        return rounding(towers + 2, abs_sum + towers * abs_sum.max(initial=0))
'''

USAGE = '''\
import keras
import numpy as np

import towers
from towers.allreduce import Record, compressed, register_codec
from towers.testing import check_codec

devices = towers.simulate_devices(4)
print(check_codec("my_codecs:Int8"))  # PASS: error feedback, devices, bytes, checkpoint, ...

from my_codecs import Int8

register_codec(Record("int8", Int8, kind="codec", summary="S/4 + 4: int8, error feedback"))
x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
trainer = towers.TowerTrainer(
    lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu"),
                              keras.layers.Dense(2)]),
    lambda: keras.optimizers.SGD(0.1),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    devices=devices, all_reduce=compressed("ring", "int8"),  # or "my_codecs:Int8", or Int8()
)
losses = [float(trainer.train_step(x, y)) for _ in range(20)]
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
'''


def _page_blocks() -> list[str]:
    text = PAGE.read_text()
    start = text.index("## Write your own codec")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)


def test_the_page_blocks_are_these() -> None:
    assert _page_blocks()[:2] == [CODEC, USAGE]


def test_the_codec_passes_its_check_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from towers.allreduce import CODECS

    (tmp_path / "my_codecs.py").write_text(CODEC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_codecs", raising=False)
    monkeypatch.setitem(CODECS, "int8", CODECS["identity"])  # undone after the test
    scope: dict[str, object] = {}
    exec(USAGE.replace("simulate_devices(4)", "local_devices()[:4]"), scope)
    out = capsys.readouterr().out
    assert out.startswith("PASS: codec my_codecs:Int8"), out
    losses = scope["losses"]
    assert isinstance(losses, list) and np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], out  # it learns: error feedback keeps the signal
    assert type(scope["trainer"].reducer.dense.codec).__name__ == "Int8"  # type: ignore[attr-defined]
    from towers.allreduce import compressed

    assert type(compressed("ring", "my_codecs:Int8").codec).__name__ == "Int8"
    with pytest.raises(ValueError, match="codec: my_codecs:Int8State must be a codec"):
        compressed("ring", "my_codecs:Int8State")
