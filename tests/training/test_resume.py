"""ExactResume: kill -9 a run at a random moment, restart it, end bitwise equal.

The run is tests/training/resume_run.py (TowerModel.fit on the digits, 3 towers,
replicated variables, Adam,
Dropout, top-k compression with error feedback: every kind of state a step depends
on). An uninterrupted run and a killed-then-resumed run must end with the same bytes
in every replica's weights, every optimizer slot, ``iterations`` and the all-reduce's
state. The kill lands after a random batch (after at least one checkpoint), plus a
random delay of up to a few steps, so it may fall inside a save. A failure names its
seed; ``TOWERS_KILL_SEED=<seed>`` replays that kill.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES
from towers.training import checkpoint
from towers.training.backup import ExactResume
from towers.training.data import digits

ROOT = Path(__file__).resolve().parents[2]
EPOCHS, EVERY, STEPS_PER_EPOCH = 3, 4, 15  # resume_run's settings (1437 digits / 96)
TOTAL = EPOCHS * STEPS_PER_EPOCH
TIMEOUT = 240


def _start(directory: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.training.resume_run", str(directory), str(out), *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str]) -> list[str]:
    """Wait (bounded) for a run; return its ``batch n`` lines."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    return [line for line in out.splitlines() if line.startswith("batch ")]


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def assert_bitwise(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Every array of ``want`` present in ``got`` with the same dtype, shape and bytes."""
    assert sorted(got) == sorted(want)
    differ = [
        k for k in want
        if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
        or got[k].tobytes() != want[k].tobytes()
    ]  # fmt: skip
    assert not differ, f"not bitwise equal: {differ}"


@pytest.mark.long  # a real kill -9 of a training process: one of the README's long proofs
def test_kill_9_and_resume_ends_bitwise_where_an_uninterrupted_run_ends(tmp_path: Path) -> None:
    seed = int(os.environ.get("TOWERS_KILL_SEED", random.randrange(2**32)))  # to replay one
    rng = random.Random(seed)
    # a global batch index after >= 1 save, leaving the run more than the delay to go
    kill_after = rng.randrange(EVERY, TOTAL - 10)
    delay = rng.uniform(0.0, 0.03)  # a step takes ~10 ms: the kill may land inside a save
    why = f"(seed {seed}: kill after batch {kill_after} + {delay * 1000:.0f} ms)"

    reference = _start(tmp_path / "ref", tmp_path / "ref.npz")
    victim = _start(tmp_path / "run", tmp_path / "run.npz")
    assert victim.stdout is not None
    seen = 0
    while seen <= kill_after:
        line = victim.stdout.readline()
        assert line, f"the run ended before the kill {why}: {victim.communicate()[1][-2000:]}"
        seen += line.startswith("batch ")
    time.sleep(delay)
    assert victim.poll() is None, f"the run ended before the kill {why}"
    victim.send_signal(signal.SIGKILL)
    rest, _ = victim.communicate(timeout=TIMEOUT)
    assert victim.returncode == -signal.SIGKILL, why
    # every batch the run reported before it died: on a loaded machine this reader lags
    # the run by a few lines (CI once: read 23, the run had saved after batch 24)
    seen += sum(line.startswith("batch ") for line in rest.splitlines())
    assert not (tmp_path / "run.npz").exists()
    saved = checkpoint.latest(tmp_path / "run")
    assert saved is not None, why
    done_before = int(checkpoint.verify(saved)["batches"])
    assert EVERY <= done_before <= seen + 1, (why, seen)

    resumed = _finish(_start(tmp_path / "run", tmp_path / "run.npz"))
    assert len(resumed) == TOTAL - done_before, why  # it went on from the checkpoint
    assert len(_finish(reference)) == TOTAL
    want, got = _load(tmp_path / "ref.npz"), _load(tmp_path / "run.npz")
    assert int(want["iterations"]) == TOTAL
    assert any(np.any(v != 0) for k, v in want.items() if k.startswith("all_reduce"))
    assert_bitwise(got, want)


def _small() -> towers.TowerModel:
    init = keras.initializers.GlorotUniform
    inp = keras.Input((64,))
    h = keras.layers.Dropout(0.2, seed=1)(inp)
    tm = towers.TowerModel(keras.Model(inp, keras.layers.Dense(10, kernel_initializer=init(2))(h)),
                           devices=DEVICES[:2], variables="replicated", all_reduce="naive")
    tm.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy")
    return tm


def _everything(tm: towers.TowerModel) -> dict[str, np.ndarray]:
    assert tm.trainer is not None
    arrays = {}
    for i, replica in enumerate(tm.trainer.replicas):
        for j, v in enumerate([*replica.model.variables, *replica.optimizer.variables]):
            arrays[f"r{i}_{j}"] = np.asarray(v.numpy())
    return arrays


def _digits_160() -> tuple[np.ndarray, np.ndarray]:
    x, y, _, _ = digits()
    order = np.random.default_rng(3).permutation(160)
    return x[:160].reshape(160, 64)[order], y[:160][order]


ARGS = {"batch_size": 32, "shuffle": False, "verbose": 0}


def test_epoch_end_checkpoints_resume_the_next_epoch_bitwise(tmp_path: Path) -> None:
    """every=None saves at each epoch's end: 2 epochs, then a new model asked for 3
    trains only the third — bitwise."""
    x, y = _digits_160()
    whole = _small()
    whole.fit(x, y, epochs=3, **ARGS)
    _small().fit(x, y, epochs=2, callbacks=[ExactResume(tmp_path)], **ARGS)
    assert [Path(p).parent.name for p in checkpoint.checkpoints(tmp_path)] == [
        "ckpt-00000005", "ckpt-00000010"]  # fmt: skip
    second = _small()
    history = second.fit(x, y, epochs=3, callbacks=[ExactResume(tmp_path)], **ARGS)
    assert len(history.history["loss"]) == 1  # only the third epoch ran
    assert int(second.optimizer.iterations) == 15
    assert_bitwise(_everything(second), _everything(whole))
    second.fit(x, y, epochs=1, **ARGS)  # the resume point does not stick to the model
    assert int(second.optimizer.iterations) == 20
    fresh = _small()  # resume=False ignores the directory's checkpoints
    fresh.fit(x, y, epochs=1, callbacks=[ExactResume(tmp_path, resume=False)], **ARGS)
    assert int(fresh.optimizer.iterations) == 5


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_a_resume_inside_an_epoch_trains_only_the_rest_of_it_bitwise(tmp_path: Path) -> None:
    """A run stopped after 7 batches (a save at 6: epoch 1, batch 1) resumes at batch 1
    of epoch 1, where Keras's BackupAndRestore would start epoch 1 over (checked below)."""
    x, y = _digits_160()
    whole = _small()
    whole.fit(x, y, epochs=2, **ARGS)

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.model.stop_training = int(self.model.optimizer.iterations) == 7

    _small().fit(x, y, epochs=2, callbacks=[ExactResume(tmp_path, every=3), Stop()], **ARGS)
    assert checkpoint.verify(checkpoint.latest(tmp_path))["batch"] == 1
    resumed, trained = _small(), []
    batches = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: trained.append(batch) if logs else None)
    resumed.fit(x, y, epochs=2, callbacks=[ExactResume(tmp_path, every=3), batches], **ARGS)
    assert trained == [1, 2, 3, 4]
    assert int(resumed.optimizer.iterations) == 10
    assert_bitwise(_everything(resumed), _everything(whole))
    keras_dir = str(tmp_path / "keras")  # Keras's own, saving every 6 batches
    with pytest.raises(RuntimeError, match="crash"):
        _small().fit(x, y, epochs=2, callbacks=[
            keras.callbacks.BackupAndRestore(keras_dir, save_freq=6), _CrashAfter7()], **ARGS)
    again = _small()
    again.fit(x, y, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(keras_dir)], **ARGS)
    assert int(again.optimizer.iterations) == 6 + 5  # epoch 1 from its start: batch 0 twice


class _CrashAfter7(keras.callbacks.Callback):
    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if int(self.model.optimizer.iterations) == 7:  # batch 1 of epoch 1
            raise RuntimeError("crash")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batch_size": 16}, "with batch_size=32, this fit has batch_size=16"),
        ({"rows": 128}, "with examples=160, this fit has examples=128"),
    ],
    ids=["batch_size", "examples"],
)
def test_resuming_with_other_batches_is_refused_before_anything_changes(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    """A position counts batches of the data it was written for: 3 batches of 32 are 96
    examples, 3 of 16 would be 48 (the other 48 silently skipped before issue 18)."""
    x, y = _digits_160()
    _small().fit(x, y, epochs=1, callbacks=[ExactResume(tmp_path, every=3)], **ARGS)
    assert [Path(p).parent.name for p in checkpoint.checkpoints(tmp_path)] == ["ckpt-00000003"]
    rows = change.pop("rows", 160)
    other = _small()
    before = _everything(other)
    with pytest.raises(towers.CheckpointError, match=re.escape(message)) as info:
        other.fit(x[:rows], y[:rows], epochs=2, callbacks=[ExactResume(tmp_path, every=3)],
                  **{**ARGS, **change})  # fmt: skip
    assert "(epoch 0, 3 batches of it trained)" in str(info.value)
    assert_bitwise(_everything(other), before)
    assert int(other.optimizer.iterations) == 0


def test_a_position_without_its_data_is_refused(tmp_path: Path) -> None:
    x, y = _digits_160()
    tm = _small()
    assert tm.trainer is not None
    checkpoint.write(tm.trainer, tmp_path, 3,
                 {"epoch": 0, "batch": 3, "batches": 3, "rng": None})  # fmt: skip
    with pytest.raises(towers.CheckpointError, match="does not record the data and batch size"):
        _small().fit(x, y, callbacks=[ExactResume(tmp_path)], **ARGS)


def test_shuffled_arrays_and_a_plain_keras_model_are_refused(tmp_path: Path) -> None:
    x, y = _digits_160()
    with pytest.raises(ValueError, match="shuffle must be False with ExactResume"):
        _small().fit(x, y, callbacks=[ExactResume(tmp_path)], batch_size=32, verbose=0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="ExactResume must be a callback of a compiled towers"):
        model.fit(x, y, callbacks=[ExactResume(tmp_path)], **ARGS)
    assert checkpoint.latest(tmp_path) is None
