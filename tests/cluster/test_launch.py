"""towers launch: one process per task with its TF_CONFIG, prefixed output, failures, timeouts.

The commands are tiny ``python -c`` programs (no TensorFlow); every launch has a --timeout,
so none can hang, and tasks that must meet wait on files, never on the clock.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from towers import cli

PRINT_TASK = (
    "import json, os; t = json.loads(os.environ['TF_CONFIG']); "
    "print('task', t['task']['type'], t['task']['index'], 'towers', os.environ['TOWERS_PER_TASK'], "
    "'workers', len(t['cluster']['worker']), 'ps', len(t['cluster'].get('ps', [])))"
)


def _launch(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli.main(["launch", *args])
    return code, capsys.readouterr().out


def test_each_task_sees_its_own_task_and_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _launch(capsys, "--workers", "2", "--towers-per-worker", "3", "--ps", "1",
                           "--timeout", "60", "--", sys.executable, "-c", PRINT_TASK)
    assert code == 0, out
    for k in (0, 1):
        assert f"[worker {k}] task worker {k} towers 3 workers 2 ps 1\n" in out, out
    assert "[ps 0] task" not in out  # parameter servers serve; they do not run the command


# Worker 1 fails only once worker 0 has started (a file in a folder both see, at most 60 s):
# failing at once could stop worker 0 before its first line on a loaded machine.
FAIL_AFTER_START = (
    "import json, os, sys, time; "
    "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
    "print('start', flush=True); open(os.path.join({ready!r}, str(i)), 'w').close()\n"
    "if i == 0: time.sleep(600)\n"
    "end = time.monotonic() + 60\n"
    "while not os.path.exists(os.path.join({ready!r}, '0')) and time.monotonic() < end: "
    "time.sleep(0.05)\n"
    "sys.exit(3)"
)


def test_a_failing_task_fails_the_launch_and_stops_the_others(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Worker 0 would sleep past the timeout: exit 3 (not 124) shows it was terminated."""
    code, out = _launch(capsys, "--workers", "2", "--timeout", "300", "--",
                           sys.executable, "-c", FAIL_AFTER_START.format(ready=str(tmp_path)))
    assert code == 3, out
    assert "[worker 0] start" in out and "[worker 1] start" in out


def test_failure_grace_lets_the_others_report_and_exit_by_themselves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The grace ends when every task has ended: the launch returns 5, not the timeout's 124."""
    program = ("import json, os, sys, time; "
               "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
               "sys.exit(3) if i == 1 else (time.sleep(1), print('noticed', flush=True), "
               "sys.exit(5))")
    code, out = _launch(capsys, "--workers", "2", "--timeout", "300",
                           "--failure-grace", "900", "--", sys.executable, "-c", program)
    assert "[worker 0] noticed" in out, out  # it ran on after worker 1 failed
    assert code == 5, out  # its own exit code counts: it ended by itself
    assert cli.main(["launch", "--failure-grace", "-1", "--", "true"]) == 2


def test_a_hanging_task_is_killed_by_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _launch(capsys, "--workers", "2", "--timeout", "2", "--",
                           sys.executable, "-c", "import time; time.sleep(600)")
    assert code == 124
    assert "[launch] timeout after 2 s" in out


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["launch", "--workers", "0", "--", "true"])
    assert exit_.value.code == 2
    assert "argument --workers: must be an integer >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["launch", "--workers", "1"]) == 2
    assert "give the command after --" in capsys.readouterr().err


# Each worker starts a child, says so, and waits (at most 30 s) until both workers have said so
# before it exits: a worker that ended first would have the launch stop the other one before
# that one had printed its child's pid.
LEAVE_CHILD = (
    "import json, os, subprocess, sys, time; "
    "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print('child', p.pid, flush=True); open(os.path.join({ready!r}, str(i)), 'w').close(); "
    "end = time.monotonic() + 30\n"
    "while len(os.listdir({ready!r})) < 2 and time.monotonic() < end: time.sleep(0.05)\n"
    "sys.exit({code} if i == 0 else 0)"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("worker_code", [0, 3])
def test_a_child_a_worker_left_running_ends_with_the_launch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, worker_code: int
) -> None:
    """Every task's whole process group ends with the launch: a worker that exits (0 or
    failing) while its own child still runs does not leave the child behind, and a launch
    whose workers all succeeded fails when one of them left a process running."""
    program = LEAVE_CHILD.format(code=worker_code, ready=str(tmp_path))
    code, out = _launch(capsys, "--workers", "2", "--timeout", "60", "--",
                        sys.executable, "-c", program)
    children = [int(line.split()[-1]) for line in out.splitlines() if " child " in line]
    assert len(children) == 2, out
    assert not any(_alive(pid) for pid in children), out
    if worker_code == 0:
        assert code == 1, out
        assert "[launch] worker 0 exited but left 1 process(es) of its group running" in out
    else:
        assert code == 3, out  # the worker's own failure is the launch's code


def test_a_clean_launch_reports_no_leftovers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _launch(capsys, "--workers", "2", "--timeout", "60", "--",
                           sys.executable, "-c", "print('done')")
    assert code == 0 and "[launch]" not in out, out
