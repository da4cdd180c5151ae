"""Numbered checkpoints in a directory: written atomically, the newest good one found.

What a save does, and what a crash at each point leaves behind::

    directory/
    │ 1. write  .tmp-ckpt-00000012-<pid>/state.index, state.data-*   crash: a .tmp-* dir,
    │           .tmp-ckpt-00000012-<pid>/position.json                      never read
    │ 2. write  .tmp-ckpt-00000012-<pid>/MANIFEST.json  (size, sha256 of every file)
    │    fsync every file, then the temporary directory
    │ 3. rename .tmp-ckpt-00000012-<pid>  ─▶  ckpt-00000012          atomic (one syscall)
    │    fsync the directory                                       crash: ckpt-12 complete
    │ 4. write  .latest.tmp, fsync, rename ─▶ latest  ("ckpt-00000012")
    │ 5. delete an older save of the same number, then the oldest beyond ``keep``
    ▼
    latest(directory): ckpt-* newest first; the first whose MANIFEST matches every
    file (size and sha256) wins; a damaged one is skipped with a warning.

``latest`` trusts the manifests, not the pointer (for people and tools). A number saved
again is ``ckpt-00000012.1``; the old one goes only at step 5.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tensorflow as tf

from towers.guard.arguments import non_negative_int, optional, positive_int
from towers.guard.errors import CheckpointError

__all__ = ["check_path", "checkpoints", "latest", "verify", "write"]

PREFIX, MANIFEST, POSITION, POINTER = "state", "MANIFEST.json", "position.json", "latest"
_NAME = re.compile(r"^ckpt-(\d+)(?:\.(\d+))?$")

crash_point: Callable[[str], None] | None = None
"""A test hook, called with "data", "manifest", "renamed", "pointer" in :func:`write`."""


def _reached(stage: str) -> None:
    if crash_point is not None:
        crash_point(stage)


def check_path(value: Any, name: str = "directory", kind: str = "a path") -> str:
    """``value`` as a ``str``; a ``TypeError`` naming ``name`` if it is not a path."""
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise TypeError(f"{name} must be {kind} (str or os.PathLike); got {value!r}")
    return str(value)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    manifest = {p.name: [p.stat().st_size, _digest(p)] for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for p in [*files, folder / MANIFEST]:
        _fsync(p)
    _fsync(folder)


def write(
    ckpt: tf.train.Checkpoint, directory: Any, number: int, position: dict[str, Any],
    keep: int | None = 3,
) -> str:  # fmt: skip
    """Save ``ckpt`` as ``directory/ckpt-<number>`` atomically, as drawn above, with
    ``position`` (JSON); keep the ``keep`` newest (None: all). Return its prefix."""
    non_negative_int("number", number)
    optional(positive_int, "keep", keep)
    root = Path(check_path(directory))
    root.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{number:08d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    ckpt.write(str(tmp / PREFIX))
    (tmp / POSITION).write_text(json.dumps(position, sort_keys=True))
    _reached("data")
    _write_manifest(tmp)
    _reached("manifest")
    older = [(k, p) for (n, k), p in _folders(root) if n == number]
    final = root / (f"{name}.{1 + max(k for k, _ in older)}" if older else name)
    os.rename(tmp, final)
    _fsync(root)
    _reached("renamed")
    pointer = root / f".{POINTER}.tmp"
    pointer.write_text(final.name + "\n")
    _fsync(pointer)
    os.replace(pointer, root / POINTER)
    _fsync(root)
    _reached("pointer")
    for _, old in older:  # replaced: only now that the new save is complete and in place
        shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        for stale in checkpoints(root)[:-keep]:
            shutil.rmtree(Path(stale).parent, ignore_errors=True)
    return str(final / PREFIX)


def checkpoints(directory: Any) -> list[str]:
    """The prefixes of every ``ckpt-*`` in ``directory``, oldest first (unverified)."""
    return [str(p / PREFIX) for _, p in _folders(Path(check_path(directory)))]


def _folders(root: Path) -> list[tuple[tuple[int, int], Path]]:
    """``((N, k), folder)`` of each ``ckpt-N`` (k = 0) and ``ckpt-N.k`` of ``root``, by age."""
    if not root.is_dir():
        return []
    found = [(_NAME.match(p.name), p) for p in root.iterdir()]
    return sorted(((int(m[1]), int(m[2] or 0)), p) for m, p in found if m)


def verify(prefix: Any) -> dict[str, Any]:
    """Check a checkpoint written by :func:`write` against its manifest; return its position
    (``CheckpointError``: no manifest or position, a file missing, truncated or corrupt)."""
    prefix = check_path(prefix, "prefix")
    folder = Path(prefix).parent
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        for name, (size, digest) in manifest.items():
            path = folder / name
            if not path.is_file():
                raise CheckpointError(prefix, f"{name} is missing")
            if path.stat().st_size != size:
                raise CheckpointError(prefix, f"{name} has {path.stat().st_size} bytes, its "
                                      f"manifest {size} (truncated?)")  # fmt: skip
            if _digest(path) != digest:
                raise CheckpointError(prefix, f"{name} does not match its sha256 (corrupt)")
        position: dict[str, Any] = json.loads((folder / POSITION).read_text())
    except (OSError, ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(prefix, f"manifest or position unreadable ({err})") from err
    return position


def latest(directory: Any) -> str | None:
    """The prefix of the newest checkpoint in ``directory`` that verifies, or None; a
    damaged newer one is skipped with a ``RuntimeWarning``."""
    for prefix in reversed(checkpoints(directory)):
        try:
            verify(prefix)
        except CheckpointError as err:
            warnings.warn(f"skipping a damaged checkpoint: {err}", RuntimeWarning, stacklevel=2)
            continue
        return prefix
    return None
