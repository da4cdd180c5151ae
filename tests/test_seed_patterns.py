"""The seed documents' device settings, as written there, then towers: nothing else changes.

TensorFlow's GPU guide and the distributed-training tutorials open with GPU settings made
before anything runs: memory growth on every GPU, and the GPUs a program may see. A
program that starts that way and then asks for towers must work as it is, on a machine
with GPUs (the settings apply; towers' CPU towers are made beside them) and without (the
loops run over nothing). Each runs in a fresh process: these settings, like towers' own
devices, must come before TensorFlow's runtime starts.

The other seed patterns have their tests beside what they exercise: the tutorial's
``strategy.run`` loop with its ``reduction="none"`` loss (tests/test_tutorial_loop.py),
``model.fit`` under ``strategy.scope()`` (tests/model/test_equality.py), CentralStorageStrategy
(tests/test_equivalence.py), ``mixed_float16`` with a ``LossScaleOptimizer``
(tests/test_mixed_precision.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # a long proof: python -m pytest -m long

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import numpy as np
import tensorflow as tf

gpus = tf.config.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
{visible}

import keras
import towers

devices = towers.simulate_devices(4, kind="cpu")
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
trainer = towers.TowerTrainer(model, keras.optimizers.SGD(0.1), "mse", devices=devices)
before = trainer.get_weights()
x = np.arange(30, dtype="float32").reshape(10, 3) / 30
loss = float(trainer.train_step(x, np.ones((10, 2), "float32")))
moved = max(float(np.max(np.abs(a - b))) for a, b in zip(trainer.get_weights(), before))
print("towers", len(devices), "gpus", len(gpus), "moved", moved > 0, "loss", np.isfinite(loss))
"""

VISIBLE = {
    "memory_growth": "",
    "first_gpu_only": 'tf.config.set_visible_devices(gpus[:1], "GPU")',
    "no_gpu": 'tf.config.set_visible_devices([], "GPU")',
}


@pytest.mark.parametrize("pattern", sorted(VISIBLE))
def test_gpu_settings_made_first_then_towers(pattern: str) -> None:
    code = PROGRAM.format(visible=VISIBLE[pattern])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1].split()
    assert last[:2] == ["towers", "4"] and last[4:] == ["moved", "True", "loss", "True"], last
