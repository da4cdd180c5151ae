"""Faults: ``kill -9`` of one worker → the other gets ``StepTimeout`` and exits; a restart
of every worker resumes from the chief's last checkpoint and finishes. Checkpoints are
numbered by steps taken (a skipped step too), and a re-save never loses the last one.

Run 1 trains on BATCHES with a checkpoint directory; worker 1 kills itself with SIGKILL
before step 3 (after the chief's checkpoint of step 3, ``ckpt-3``). Worker 0 waits in
its all-reduce until the step timeout (8 s) and reports ``StepTimeout``; ``launch``
gives it a grace period to exit by itself. Run 2 (every worker restarted) restores
``ckpt-3`` on both workers, bitwise the chief's weights when it wrote it, and finishes
bitwise where the uninterrupted run (``straight_run``) ended.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import towers
from tests.cluster.conftest import BATCHES, LR, Run, run_workers
from tests.cluster.train_worker import make_model
from tests.conftest import DEVICES
from towers.cluster import launch, local_cluster
from towers.cluster.cross_worker import restore_latest, save_on_chief
from towers.training import checkpoint
from towers.training.data import digits

pytestmark = pytest.mark.long  # a long proof: python -m pytest -m long

TIMEOUT = 8.0
"""Step and collective timeout of the runs (start-up skew is absorbed by a barrier)."""
DIE_AT = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run, Path]:
    ckpt = tmp_path_factory.mktemp("ckpt")
    args = ("--batches", ",".join(map(str, BATCHES)), "--lr", str(LR), "--ckpt", str(ckpt),
            "--timeout", str(TIMEOUT))
    crashed = run_workers(*args, "--die-at", str(DIE_AT), grace=3 * TIMEOUT)
    resumed = run_workers(*args)
    return crashed, resumed, ckpt


def test_the_survivor_reports_step_timeout_and_exits_nonzero(runs: tuple[Run, Run, Path]) -> None:
    crashed, _, _ = runs
    assert crashed.code == 128 + 9, crashed.out[-4000:]  # worker 1's SIGKILL
    failed = crashed.lines("FAILED")
    assert list(failed) == [0], crashed.out[-4000:]
    kind, seconds = failed[0][0][0], float(failed[0][0][1])
    print(f"\nsurvivor: {kind} {seconds} s after its step began (timeout {TIMEOUT} s)")
    assert kind == "StepTimeout"
    assert TIMEOUT - 0.5 <= seconds <= TIMEOUT + 5.0  # detected by the deadline, not a hang
    assert "[worker 0] DONE" not in crashed.out
    assert [int(f[0]) for f in crashed.lines("STEP")[0]] == list(range(DIE_AT))


def test_the_chief_alone_wrote_each_step_atomically(runs: tuple[Run, Run, Path]) -> None:
    _, _, ckpt = runs
    names = sorted(os.listdir(ckpt))
    steps = [f"ckpt-{k:08d}" for k in range(1, len(BATCHES) + 1)]  # numbered by steps taken
    assert names == [*steps, checkpoint.POINTER], names
    assert checkpoint.latest(ckpt) == str(ckpt / steps[-1] / checkpoint.PREFIX)


def test_every_worker_resumes_bitwise_and_finishes_like_the_straight_run(
    runs: tuple[Run, Run, Path], straight_run: tuple[Run, Path],
) -> None:
    crashed, resumed, _ = runs
    assert resumed.code == 0, resumed.out[-4000:]
    restored = {w: f[0] for w, f in resumed.lines("RESTORED").items()}
    assert restored[0] == restored[1]  # [step, digest]: the same bits on every worker
    assert int(restored[0][0]) == DIE_AT
    chief_at_checkpoint = crashed.lines("STEP")[0][DIE_AT - 1][2]
    assert restored[0][1] == chief_at_checkpoint
    done = {w: f[0][0] for w, f in resumed.lines("DONE").items()}
    straight = {w: f[0][0] for w, f in straight_run[0].lines("DONE").items()}
    assert done == straight and len(set(done.values())) == 1


@pytest.fixture(scope="module")
def skipped_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    """Like ``runs``, with step 1 skipped on every worker (NaN inputs)."""
    ckpt = tmp_path_factory.mktemp("ckpt_skipped")
    args = ("--batches", ",".join(map(str, BATCHES)), "--lr", str(LR), "--ckpt", str(ckpt),
            "--timeout", str(TIMEOUT), "--nan-at", "1")  # fmt: skip
    return run_workers(*args, "--die-at", str(DIE_AT), grace=3 * TIMEOUT), run_workers(*args)


def test_a_skipped_step_in_the_worker_loop_replays_no_batch(
    skipped_runs: tuple[Run, Run],
) -> None:
    """Step 1 is skipped, so ``iterations`` is 2 after step 2. Keyed on it, the restart
    resumed at step 2 and trained batch 2 twice; keyed on steps taken it goes on at 3."""
    crashed, resumed = skipped_runs
    assert crashed.code == 128 + 9 and resumed.code == 0, resumed.out[-4000:]
    steps = crashed.lines("STEP")[0]
    assert steps[1][2] == steps[0][2]  # the skipped step changed nothing
    restored = {w: f[0] for w, f in resumed.lines("RESTORED").items()}
    assert restored[0] == restored[1] == [str(DIE_AT), steps[DIE_AT - 1][2]]
    for worker in (0, 1):
        trained = [int(f[0]) for f in resumed.lines("STEP")[worker]]
        assert trained == list(range(DIE_AT, len(BATCHES))), resumed.out[-4000:]


def test_a_negative_failure_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="failure_grace"):
        launch(local_cluster(1), 1, ["true"], failure_grace=-1)


CHIEF = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
         "task": {"type": "worker", "index": 0}}  # fmt: skip


def _trainer() -> towers.TowerTrainer:
    return towers.TowerTrainer(make_model, keras.optimizers.SGD(LR),
                               keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                               devices=DEVICES[:2], variables="replicated")  # fmt: skip


def test_without_a_checkpoint_nothing_is_restored(tmp_path: Path) -> None:
    trainer = _trainer()
    assert restore_latest(trainer, str(tmp_path)) == 0
    checkpoint.write(trainer, tmp_path, 9, {"batches": 9})
    with pytest.raises(towers.CheckpointError, match="no count of steps taken"):
        restore_latest(trainer, str(tmp_path))


def test_only_the_chief_saves_and_every_worker_restores(tmp_path: Path) -> None:
    trainer = _trainer()
    worker1 = {**CHIEF, "task": {"type": "worker", "index": 1}}
    assert save_on_chief(trainer, str(tmp_path), 0, worker1) is None
    assert os.listdir(tmp_path) == []
    written = save_on_chief(trainer, str(tmp_path), 0, CHIEF)
    assert written == str(tmp_path / "ckpt-00000000" / checkpoint.PREFIX)
    assert restore_latest(trainer, str(tmp_path)) == 0


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """Four batches of 16 digits; the first all NaN (the guard skips that step)."""
    x, y, _, _ = digits()
    out = [(x[16 * k : 16 * (k + 1)], y[16 * k : 16 * (k + 1)]) for k in range(4)]
    out[0] = (np.full_like(out[0][0], np.nan), out[0][1])
    return out


def _loop(trainer: towers.TowerTrainer, directory: Path | None, stop: int) -> list[int]:
    """docs/multi_worker.md's loop (tests/cluster/train_worker.py's), up to step ``stop``."""
    start = restore_latest(trainer, str(directory)) if directory else 0
    trained = []
    for step, (x, y) in enumerate(_batches()[start:stop], start):
        trainer.train_step(x, y)
        trained.append(step)
        if directory:
            save_on_chief(trainer, str(directory), step + 1, CHIEF)
    return trained


def test_a_skipped_step_is_counted_so_a_resume_replays_no_batch(tmp_path: Path) -> None:
    """Step 0 is skipped (NaN): ``iterations`` stays one behind the steps taken. Keyed on
    it, the run killed after step 1 resumed at step 1 and trained batch 1 twice."""
    crashed = _trainer()
    assert _loop(crashed, tmp_path, 2) == [0, 1]
    assert (crashed.skipped_steps, int(crashed.optimizer.iterations)) == (1, 1)
    resumed = _trainer()
    assert _loop(resumed, tmp_path, 4) == [2, 3]
    straight = _trainer()
    _loop(straight, None, 4)
    for got, want in zip(resumed.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(resumed.optimizer.iterations) == int(straight.optimizer.iterations) == 3


@pytest.mark.parametrize("fail", ["rename", "rmtree"])
def test_a_crash_inside_a_resave_leaves_a_restorable_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    """The chief saves step 1 again (e.g. after a restart): the rename of the new folder
    or the deletion of the old one crashes; a good ckpt-1 is restorable either way."""
    trainer, (x, y) = _trainer(), _batches()[1]
    trainer.train_step(x, y)
    save_on_chief(trainer, str(tmp_path), 1, CHIEF)
    first = [w.copy() for w in trainer.get_weights()]
    trainer.train_step(x, y)
    real: Any = {"rename": os.rename, "rmtree": shutil.rmtree}[fail]

    def crash(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(args[0] if fail == "rename" else path).name.startswith("ckpt-00000001"):
            raise OSError(f"crash: {fail}")
        real(path, *args, **kwargs)

    monkeypatch.setattr(os if fail == "rename" else shutil, fail, crash)
    with pytest.raises(OSError, match=f"crash: {fail}"):
        save_on_chief(trainer, str(tmp_path), 1, CHIEF)
    monkeypatch.undo()
    fresh = _trainer()
    assert restore_latest(fresh, str(tmp_path)) == 1
    want = first if fail == "rename" else trainer.get_weights()  # the old, or the new one
    for got, expected in zip(fresh.get_weights(), want, strict=True):
        np.testing.assert_array_equal(got, expected)
