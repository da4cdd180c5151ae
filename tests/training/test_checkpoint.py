"""towers.training.checkpoint and export: bitwise resume in a new process; exports reload."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce.codecs import fp16, topk
from towers.allreduce.powersgd import powersgd
from towers.testing import assert_weights_close
from towers.training import checkpoint
from towers.training.data import digits
from towers.training.export import export

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh process: `python3 -c SCRIPT MODE CKPT OUT`. MODE "first" trains STEPS steps,
# saving after SAVE_AT; MODE "resume" restores that checkpoint and trains the remaining steps.
# The model has Dropout (its seed state must come back) and Adam (its slots), and the
# all-reduce is a tf.Module with error-feedback residuals: state that shapes every next step.
SCRIPT = '''
import sys
import towers
devices = towers.simulate_devices(4)
import keras
import numpy as np
import tensorflow as tf
from towers.training import checkpoint
from towers.allreduce.naive import naive
from towers.training.data import digits

STEPS, SAVE_AT, BATCH = 6, 3, 48


class Fp16Feedback(tf.Module):
    """Send gradients as float16; keep what rounding lost per tower and add it next step."""

    def build(self, variables, devices):
        self.devices = list(devices)
        self.residuals = []
        for d in self.devices:
            with tf.device(d):
                self.residuals.append([tf.Variable(tf.zeros(v.shape)) for v in variables])

    def reduce_gradients(self, grads):
        sent = []
        for device, residual, g in zip(self.devices, self.residuals, grads):
            with tf.device(device):
                full = [a + r for a, r in zip(g, residual)]
                rounded = [tf.cast(tf.cast(f, tf.float16), tf.float32) for f in full]
                for r, f, c in zip(residual, full, rounded):
                    r.assign(f - c)
                sent.append(rounded)
        per_var = [naive([s[j] for s in sent]) for j in range(len(sent[0]))]
        return [[out[i] for out in per_var] for i in range(len(self.devices))]


def make():
    inp = keras.Input((8, 8, 1))
    init = keras.initializers.GlorotUniform
    h = keras.layers.Conv2D(8, 3, activation="relu", kernel_initializer=init(0))(inp)
    h = keras.layers.Dropout(0.3, seed=7)(keras.layers.Flatten()(h))
    out = keras.layers.Dense(10, kernel_initializer=init(1))(h)
    return keras.Model(inp, out)


trainer = towers.TowerTrainer(
    make, lambda: keras.optimizers.Adam(1e-2),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    devices=devices, all_reduce=Fp16Feedback(), variables="replicated",
)
x, y, _, _ = digits()
mode, ckpt, out = sys.argv[1:4]
first = 0
if mode == "resume":
    checkpoint.restore(trainer, ckpt)
    first = int(trainer.optimizer.iterations)
for step in range(first, STEPS):
    trainer.train_step(x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH])
    if mode == "first" and step + 1 == SAVE_AT:
        checkpoint.save(trainer, ckpt)
arrays = {f"w{i}": w for i, w in enumerate(trainer.get_weights())}
arrays["residual"] = trainer.algorithm.residuals[1][0].numpy()
arrays["first"] = np.array(first)
np.savez(out, **arrays)
'''


def _run(*args: str) -> dict[str, np.ndarray]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(args[2]) as data:
        return dict(data)


@pytest.mark.long
def test_resume_in_a_new_process_is_bitwise(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = _run("first", ckpt, str(tmp_path / "first.npz"))
    resumed = _run("resume", ckpt, str(tmp_path / "resumed.npz"))
    assert int(resumed["first"]) == 3  # it did restart from the saved step
    weights = sorted(k for k in uninterrupted if k.startswith("w"))
    assert_weights_close(
        [resumed[k] for k in weights], [uninterrupted[k] for k in weights], what="resumed"
    )
    np.testing.assert_array_equal(resumed["residual"], uninterrupted["residual"])
    assert np.any(resumed["residual"] != 0)  # the compression state was real state


def _small(n: int, variables: str = "replicated") -> towers.TowerTrainer:
    def make() -> keras.Model:
        inp = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(4, 3, activation="relu")(inp)
        return keras.Model(inp, keras.layers.Dense(10)(keras.layers.Flatten()(h)))

    return towers.TowerTrainer(
        make,
        lambda: keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=DEVICES[:n],
        all_reduce="naive",
        variables=variables,
    )


def test_checkpoint_holds_every_replica_and_the_step(tmp_path: Path) -> None:
    trainer = _small(3)
    x, y, _, _ = digits()
    trainer.train_step(x[:30], y[:30])
    keys = {k for k, _ in tf.train.list_variables(checkpoint.save(trainer, str(tmp_path / "c")))}
    n_model, n_opt = len(trainer.model.variables), len(trainer.optimizer.variables)
    for i in range(3):
        assert sum(k.startswith(f"replica_{i}/model/") for k in keys) == n_model
        # replica 0's iteration counter is saved once, as "step"
        assert sum(k.startswith(f"replica_{i}/optimizer/") for k in keys) == n_opt - (i == 0)
    assert "step/.ATTRIBUTES/VARIABLE_VALUE" in keys


def test_restore_into_a_different_trainer_fails_before_changing_it(tmp_path: Path) -> None:
    source = _small(3)
    x, y, _, _ = digits()
    source.train_step(x[:30], y[:30])
    prefix = checkpoint.save(source, str(tmp_path / "c"))
    other = _small(2)
    before = other.replica_weights()
    with pytest.raises(ValueError, match="does not match this trainer"):
        checkpoint.restore(other, prefix)
    for now, then in zip(other.replica_weights(), before):
        assert_weights_close(now, then, what="untouched")


def test_export_reloads_as_keras_and_saved_model(tmp_path: Path) -> None:
    trainer = _small(2, variables="parameter_device")
    x, y, x_test, _ = digits()
    for i in range(0, 128, 32):
        trainer.train_step(x[i : i + 32], y[i : i + 32])
    out = export(trainer, str(tmp_path / "digits"))
    expected = np.asarray(trainer.model(x_test, training=False))
    # .keras: the same layers on the same weights, run the same way: bitwise.
    reloaded = keras.models.load_model(out.keras)
    np.testing.assert_array_equal(np.asarray(reloaded(x_test, training=False)), expected)
    # SavedModel: a traced graph that Grappler may fuse (Conv2D+BiasAdd+Relu, MatMul+BiasAdd),
    # rounding differently; measured bitwise here, promised only to a few float32 ULPs.
    loaded = tf.saved_model.load(out.saved_model)  # keep it: its variables die with it
    served = loaded.serve(tf.constant(x_test)).numpy()
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"^path"):
        export(trainer, out.keras)


# --- all or nothing: a checkpoint that does not fit, or is damaged, changes nothing ------------


def _compressed(codec: Any, dtype: str = "float32") -> towers.TowerTrainer:
    def make() -> keras.Model:
        inp = keras.Input((64,), dtype=dtype)
        h = keras.layers.Dense(16, activation="relu", dtype=dtype)(inp)
        return keras.Model(inp, keras.layers.Dense(10, dtype=dtype)(h))

    return towers.TowerTrainer(
        make, lambda: keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=DEVICES[:3], all_reduce=towers.compressed("ring", codec), variables="replicated",
    )  # fmt: skip


def _everything(trainer: towers.TowerTrainer) -> list[bytes]:
    """Every variable a restore could write: replicas, optimizer slots, codec state."""
    found = [v for r in trainer.replicas for v in [*r.model.variables, *r.optimizer.variables]]
    if isinstance(trainer.algorithm, tf.Module):
        found += list(trainer.algorithm.variables)
    return [np.asarray(v.numpy()).tobytes() for v in found]


def _trained(trainer: towers.TowerTrainer, steps: int = 1) -> towers.TowerTrainer:
    x, y, _, _ = digits()
    for k in range(steps):
        trainer.train_step(x[30 * k : 30 * (k + 1)].reshape(30, 64), y[30 * k : 30 * (k + 1)])
    return trainer


@pytest.mark.long
@pytest.mark.parametrize(
    ("saved", "target", "fragment"),
    [
        # the record names the codec and its settings before any state is compared
        (lambda: powersgd(2), lambda: powersgd(1), r"holds all-reduce compressed\(ring, PowerSGD"),
        (lambda: topk(0.5), lambda: fp16(), r"\(12 state values\), trainer has .*Cast.* \(0\)"),
        (lambda: fp16(), lambda: topk(0.5), r"\(0 state values\), trainer has .*TopK"),
    ],
    ids=["powersgd-rank", "state-vs-stateless", "stateless-vs-state"],
)
def test_restore_with_other_codec_state_changes_nothing(
    tmp_path: Path, saved: Any, target: Any, fragment: str
) -> None:
    prefix = checkpoint.save(_trained(_compressed(saved())), str(tmp_path / "c"))
    other = _trained(_compressed(target()), 2)
    before = _everything(other)
    with pytest.raises(towers.CheckpointError, match=fragment) as info:
        checkpoint.restore(other, prefix)
    assert info.value.path == prefix
    assert _everything(other) == before


@pytest.mark.long
def test_restore_with_other_dtypes_changes_nothing(tmp_path: Path) -> None:
    prefix = checkpoint.save(_trained(_compressed(topk(0.5), "float64")), str(tmp_path / "c"))
    other = _trained(_compressed(topk(0.5)))
    before = _everything(other)
    with pytest.raises(towers.CheckpointError, match=r"float64\[64, 16\] in the checkpoint"):
        checkpoint.restore(other, prefix)
    assert _everything(other) == before


def _damage(prefix: str, suffix: str, how: str) -> None:
    (name,) = glob.glob(prefix + suffix)
    data = Path(name).read_bytes()
    if how == "truncate":
        Path(name).write_bytes(data[: len(data) // 2])
    else:  # flip bytes in the middle of the file
        mid = len(data) // 2
        Path(name).write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 16])
                               + data[mid + 16 :])  # fmt: skip


@pytest.mark.long
@pytest.mark.parametrize(
    ("suffix", "how"),
    [(".index", "truncate"), (".data-*", "truncate"), (".data-*", "corrupt"),
     (".index", "corrupt")],
)  # fmt: skip
def test_damaged_checkpoint_raises_checkpoint_error_naming_the_path(
    tmp_path: Path, suffix: str, how: str
) -> None:
    prefix = checkpoint.save(_trained(_compressed(topk(0.5))), str(tmp_path / "c"))
    _damage(prefix, suffix, how)
    other = _trained(_compressed(topk(0.5)), 2)
    before = _everything(other)
    with pytest.raises(towers.CheckpointError, match=re.escape(prefix)):
        checkpoint.restore(other, prefix)
    assert _everything(other) == before


def test_missing_checkpoint_raises_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(towers.CheckpointError, match="cannot be read"):
        checkpoint.restore(_small(2), str(tmp_path / "nothing"))


@pytest.mark.long
def test_matching_restore_still_round_trips(tmp_path: Path) -> None:
    source = _trained(_compressed(topk(0.5)), 2)
    prefix = checkpoint.save(source, str(tmp_path / "c"))
    other = _trained(_compressed(topk(0.5)))
    checkpoint.restore(other, prefix)
    assert _everything(other) == _everything(source)
