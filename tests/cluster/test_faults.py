"""Faults: ``kill -9`` of one worker → the other gets ``StepTimeout`` and exits; a restart
of every worker resumes from the chief's last checkpoint and finishes.

Run 1 trains on BATCHES with a checkpoint directory; worker 1 kills itself with SIGKILL
before step 3 (after the chief's checkpoint of step 3, ``ckpt-3``). Worker 0 waits in
its all-reduce until the step timeout (8 s) and reports ``StepTimeout``; ``launch``
gives it a grace period to exit by itself. Run 2 (every worker restarted) restores
``ckpt-3`` on both workers, bitwise the chief's weights when it wrote it, and finishes
bitwise where the uninterrupted run (``straight_run``) ended.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cluster.conftest import BATCHES, LR, Run, run_workers
from towers.cluster import launch, local_cluster
from towers.cluster.checkpoints import LATEST, latest, restore_latest, save_on_chief

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
    assert names == [LATEST] + [f"ckpt-{k}" for k in range(1, len(BATCHES) + 1)], names
    assert latest(str(ckpt)) == str(ckpt / f"ckpt-{len(BATCHES)}" / "state")


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


def test_a_negative_failure_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="failure_grace"):
        launch(local_cluster(1), 1, ["true"], failure_grace=-1)


def test_without_a_checkpoint_nothing_is_restored(tmp_path: Path) -> None:
    assert latest(str(tmp_path)) is None
    (tmp_path / LATEST).write_text("ckpt-9")
    with pytest.raises(ValueError, match="ckpt-9"):
        latest(str(tmp_path))


def test_only_the_chief_saves_and_every_worker_restores(tmp_path: Path) -> None:
    import keras

    import towers
    from tests.cluster.train_worker import make_model
    from tests.conftest import DEVICES

    trainer = towers.TowerTrainer(make_model, keras.optimizers.SGD(LR), "mse",
                                  devices=DEVICES[:2], variables="replicated")
    worker1 = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
               "task": {"type": "worker", "index": 1}}
    assert save_on_chief(trainer, str(tmp_path), worker1) is None
    assert os.listdir(tmp_path) == []
    chief = {**worker1, "task": {"type": "worker", "index": 0}}
    written = save_on_chief(trainer, str(tmp_path), chief)
    assert written == str(tmp_path / "ckpt-0")
    assert restore_latest(trainer, str(tmp_path)) == 0
