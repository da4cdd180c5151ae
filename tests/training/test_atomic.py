"""towers.training.checkpoint.write: a half-written or damaged checkpoint is never picked up.

A save that stops at any stage (an exception, or ``os._exit`` in a subprocess) leaves
the previous checkpoint as ``latest``; a newest checkpoint truncated at any byte offset
or with flipped bytes is skipped by ``latest`` with a warning, and ``load`` of that
very checkpoint is a ``CheckpointError`` naming it, with the trainer unchanged.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES, replica_bytes
from towers.training import checkpoint

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("data", "manifest", "renamed", "pointer")
"""The ends of write's stages (the module's drawing): the data written, the manifest
written, the folder renamed into place, the ``latest`` pointer moved."""


def crashing_at(stage: str, crash: Callable[[], None]) -> tuple[Any, str, Callable[..., None]]:
    """``(owner, name, replacement)``: patched in, ``write`` calls ``crash()`` where ``stage``
    ends, just before or after it writes the manifest or moves the pointer (its one
    ``os.replace``). tests/training/resume_run.py crashes a process the same way."""
    owner, name = (checkpoint, "_write_manifest") if stage in STAGES[:2] else (os, "replace")
    real, after = getattr(owner, name), stage in ("manifest", "pointer")

    def crashing(*args: Any) -> None:
        if not after:
            crash()
        real(*args)
        crash()

    return owner, name, crashing


def _trainer() -> towers.TowerTrainer:
    def make() -> keras.Model:
        inp = keras.Input((4,))
        return keras.Model(inp, keras.layers.Dense(3, kernel_initializer="ones")(inp))

    return towers.TowerTrainer(
        make, lambda: keras.optimizers.Adam(0.1), "sparse_categorical_crossentropy",
        devices=DEVICES[:2], variables="replicated", all_reduce="naive",
    )  # fmt: skip


X, Y = np.arange(24, dtype="float32").reshape(6, 4) / 24, np.array([0, 1, 2, 0, 1, 2])


@functools.cache
def _saved() -> tuple[Path, towers.TowerTrainer]:
    """A trainer saved after step 1 (``ckpt-1``) and after step 2 (``ckpt-2``), once."""
    trainer, directory = _trainer(), Path(tempfile.mkdtemp(prefix="towers-atomic-"))
    for n in (1, 2):
        trainer.train_step(X, Y)
        checkpoint.write(trainer, directory, n, {"n": n})
    return directory, trainer


@functools.cache
def _other() -> towers.TowerTrainer:
    return _trainer()


@pytest.fixture
def two_saves(tmp_path: Path) -> Iterator[tuple[towers.TowerTrainer, str, str]]:
    """A fresh copy of :func:`_saved`'s directory: the trainer and both prefixes."""
    directory, trainer = _saved()
    shutil.copytree(directory, tmp_path / "run")
    first, second = checkpoint.checkpoints(tmp_path / "run")
    yield trainer, first, second


def test_latest_is_the_newest_and_verify_returns_its_position(two_saves: Any) -> None:
    _, first, second = two_saves
    assert checkpoint.latest(Path(first).parents[1]) == second
    assert checkpoint.verify(second) == {"n": 2}
    assert (Path(first).parents[1] / checkpoint.POINTER).read_text().strip() == "ckpt-00000002"


def _state_at(prefix: str) -> list[bytes]:
    """What a trainer holds after loading ``prefix`` (read back by a fresh trainer)."""
    fresh = _trainer()
    checkpoint.restore(fresh, prefix)
    return replica_bytes(fresh)


@pytest.mark.parametrize("stage", STAGES)
def test_a_save_that_fails_at_any_stage_leaves_a_good_latest(
    two_saves: Any, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer, _, second = two_saves
    directory = Path(second).parents[1]
    trainer.train_step(X, Y)

    def crash() -> None:
        raise OSError(f"disk full at {stage}")

    monkeypatch.setattr(*crashing_at(stage, crash))
    with pytest.raises(OSError, match=stage):
        checkpoint.write(trainer, directory, 3, {"n": 3})
    monkeypatch.undo()
    complete = STAGES.index(stage) >= STAGES.index("renamed")
    want = str(directory / "ckpt-00000003" / checkpoint.PREFIX) if complete else second
    assert checkpoint.latest(directory) == want
    pointer = (directory / checkpoint.POINTER).read_text().strip()
    # the pointer moves only after the data is complete and renamed into place
    assert pointer == ("ckpt-00000003" if stage == "pointer" else "ckpt-00000002")


def _cut(path: Path, offset: int) -> None:
    path.write_bytes(path.read_bytes()[:offset])


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "fraction"), [(_cut, 0.0), (_cut, 0.01), (_cut, 0.5), (_cut, 0.99), (_flip, 0.5)]
)
@pytest.mark.parametrize("name", ["state.index", "state.data-00000-of-00001", "position.json"])
def test_a_damaged_newest_checkpoint_is_skipped_and_refused_by_name(
    two_saves: Any, name: str, damage: Any, fraction: float
) -> None:
    _, first, second = two_saves
    path = Path(second).parent / name
    damage(path, min(int(path.stat().st_size * fraction), path.stat().st_size - 1))
    with pytest.warns(RuntimeWarning, match="skipping a damaged checkpoint.*ckpt-00000002"):
        assert checkpoint.latest(Path(second).parents[1]) == first
    other = _other()
    before = replica_bytes(other)
    with pytest.raises(towers.CheckpointError, match=f"{second!r}.*{name}"):
        checkpoint.load(other, second)
    assert replica_bytes(other) == before
    assert checkpoint.load(other, first) == {"n": 1}
    assert replica_bytes(other) == _state_at(first)


def test_a_missing_manifest_or_file_is_skipped(two_saves: Any) -> None:
    _, first, second = two_saves
    (Path(second).parent / "state.index").unlink()
    with pytest.warns(RuntimeWarning, match="state.index is missing"):
        assert checkpoint.latest(Path(first).parents[1]) == first
    (Path(first).parent / checkpoint.MANIFEST).unlink()
    with pytest.warns(RuntimeWarning) as warned:
        assert checkpoint.latest(Path(first).parents[1]) is None
    assert len(warned) == 2
    assert "ckpt-00000002/state': state.index is missing" in str(warned[0].message)
    assert "ckpt-00000001/state': manifest or position unreadable" in str(warned[1].message)


def test_keep_deletes_only_the_oldest(tmp_path: Path) -> None:
    trainer = _trainer()
    for n in range(5):
        checkpoint.write(trainer, tmp_path, n, {}, keep=2)
    assert [Path(p).parent.name for p in checkpoint.checkpoints(tmp_path)] == [
        "ckpt-00000003", "ckpt-00000004"]  # fmt: skip


def test_bad_arguments_name_themselves(tmp_path: Path) -> None:
    trainer = _trainer()
    with pytest.raises(TypeError, match="directory must be a path"):
        checkpoint.latest(None)
    with pytest.raises(ValueError, match="number must be an int >= 0"):
        checkpoint.write(trainer, tmp_path, -1, {})
    with pytest.raises(ValueError, match="keep must be None or an int >= 1"):
        checkpoint.write(trainer, tmp_path, 1, {}, keep=0)
    assert checkpoint.latest(tmp_path / "nothing") is None


@pytest.mark.long
def test_os_exit_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """The process dies inside its second save (resume_run saves after batches 4 and 8),
    after the data and before the manifest: ckpt-4 stays latest."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    stage = "manifest"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.training.resume_run", str(tmp_path / "run"),
         str(tmp_path / "out.npz"), stage],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 3 and f"crash {stage}" in proc.stdout, proc.stderr[-2000:]
    saved = checkpoint.latest(tmp_path / "run")
    assert saved is not None and checkpoint.verify(saved)["batches"] == 4  # the first save
    left = [p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".tmp-")]
    assert len(left) == 1 and left[0].startswith(".tmp-ckpt-00000008-")  # never listed


def _resave(trainer: towers.TowerTrainer, directory: Path) -> str:
    """Save ``trainer`` again under a number ``directory`` already holds (2)."""
    return checkpoint.write(trainer, directory, 2, {"n": "again"})


@pytest.mark.parametrize("fail", ["rename", "rmtree"])
def test_a_crash_inside_a_resave_of_the_same_number_leaves_a_good_checkpoint(
    two_saves: Any, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    """Re-saving ckpt-2 used to delete the old ckpt-2 before the new one was in place.
    Now the old one is deleted last: a crash when the new one is renamed into place keeps
    the old one; a crash when the old one is deleted keeps both, and the new one wins."""
    trainer, _, second = two_saves
    directory = Path(second).parents[1]
    old_state = _state_at(second)
    trainer.train_step(X, Y)  # the state the re-save holds differs from the old ckpt-2's
    rename, rmtree = os.rename, shutil.rmtree

    def crash_rename(src: Any, dst: Any) -> None:
        if Path(dst).name.startswith("ckpt-00000002"):
            raise OSError("crash: rename")
        rename(src, dst)

    def crash_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == "ckpt-00000002":
            raise OSError("crash: rmtree")
        rmtree(path, *args, **kwargs)

    if fail == "rename":
        monkeypatch.setattr(checkpoint.os, "rename", crash_rename)
    else:
        monkeypatch.setattr(checkpoint.shutil, "rmtree", crash_rmtree)
    with pytest.raises(OSError, match=f"crash: {fail}"):
        _resave(trainer, directory)
    monkeypatch.undo()
    prefix = checkpoint.latest(directory)
    assert prefix is not None and (directory / "ckpt-00000002").is_dir()
    if fail == "rename":
        assert prefix == second and _state_at(prefix) == old_state
    else:
        assert Path(prefix).parent.name == "ckpt-00000002.1"
        assert checkpoint.verify(prefix) == {"n": "again"}
        assert _state_at(prefix) == replica_bytes(trainer)


def test_a_resave_replaces_the_old_folder_only_once_it_is_in_place(two_saves: Any) -> None:
    trainer, first, second = two_saves
    directory = Path(second).parents[1]
    trainer.train_step(X, Y)
    prefix = _resave(trainer, directory)
    assert checkpoint.checkpoints(directory) == [first, prefix]
    assert Path(prefix).parent.name == "ckpt-00000002.1"
    assert (directory / checkpoint.POINTER).read_text().strip() == "ckpt-00000002.1"
    assert checkpoint.latest(directory) == prefix and _state_at(prefix) == replica_bytes(trainer)
