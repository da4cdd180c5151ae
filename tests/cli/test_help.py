"""``towers --help`` answers without TensorFlow: the package's names load lazily.

Each help runs in a fresh interpreter under ``-X importtime``, which lists every module
the process imported; TensorFlow and Keras must not be among them. No timing is asserted:
not importing TensorFlow is what makes the help fast (about 0.1 s instead of 4 s here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from towers.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("tensorflow", "keras")


def _imported(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime *args`` from the worktree; (the process, modules imported)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")}
    return proc, modules


@pytest.mark.parametrize("command", ["", *COMMANDS], ids=["towers", *COMMANDS])
def test_help_does_not_import_tensorflow(command: str) -> None:
    proc, modules = _imported("-m", "towers", *([command] if command else []), "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: towers" in proc.stdout
    assert "towers.cli" in modules  # importtime saw the command line load
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"towers {command} --help imported {heavy[:5]}"


def test_import_towers_is_lazy_and_every_public_name_resolves() -> None:
    code = ("import sys, towers\n"
            "assert 'tensorflow' not in sys.modules, 'import towers imported tensorflow'\n"
            "import towers.split\n"  # the submodule must not hide the function
            "missing = [n for n in towers.__all__ if getattr(towers, n, None) is None]\n"
            "assert not missing, missing\n"
            "assert callable(towers.split) and towers.split.__module__ == 'towers.split'\n"
            "from towers import TowerTrainer\n"
            "assert TowerTrainer.__module__ == 'towers.step'\n"
            "print('ok')\n")
    proc, _ = _imported("-c", code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_an_unknown_name_is_an_attribute_error() -> None:
    import towers

    with pytest.raises(AttributeError, match="no attribute 'TowerTrainr'"):
        towers.TowerTrainr  # noqa: B018
