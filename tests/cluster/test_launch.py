"""towers launch: one process per task with its TF_CONFIG, prefixed output, failures, timeouts.

The commands are tiny ``python -c`` programs (no TensorFlow), so each test takes about a
second; every launch has a --timeout, so none can hang.
"""

from __future__ import annotations

import sys
import time

import pytest

from towers import cli

PRINT_TASK = (
    "import json, os; t = json.loads(os.environ['TF_CONFIG']); "
    "print('task', t['task']['type'], t['task']['index'], 'towers', os.environ['TOWERS_PER_TASK'], "
    "'workers', len(t['cluster']['worker']), 'ps', len(t['cluster'].get('ps', [])))"
)


def _launch(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    code = cli.main(["launch", *args])
    return code, capsys.readouterr().out, time.monotonic() - start


def test_each_task_sees_its_own_task_and_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _launch(capsys, "--workers", "2", "--towers-per-worker", "3", "--ps", "1",
                           "--timeout", "60", "--", sys.executable, "-c", PRINT_TASK)
    assert code == 0, out
    for k in (0, 1):
        assert f"[worker {k}] task worker {k} towers 3 workers 2 ps 1\n" in out, out
    assert "[ps 0] task" not in out  # parameter servers serve; they do not run the command


def test_a_failing_task_fails_the_launch_and_stops_the_others(
    capsys: pytest.CaptureFixture[str],
) -> None:
    program = ("import json, os, sys, time; "
               "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
               "print('start', flush=True); sys.exit(3) if i == 1 else time.sleep(60)")
    code, out, seconds = _launch(capsys, "--workers", "2", "--timeout", "60", "--",
                                 sys.executable, "-c", program)
    assert code == 3, out
    assert "[worker 0] start" in out and "[worker 1] start" in out
    assert seconds < 20  # worker 0 was terminated, not waited for


def test_failure_grace_lets_the_others_report_and_exit_by_themselves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    program = ("import json, os, sys, time; "
               "i = json.loads(os.environ['TF_CONFIG'])['task']['index']; "
               "sys.exit(3) if i == 1 else (time.sleep(1), print('noticed', flush=True), "
               "sys.exit(5))")
    code, out, seconds = _launch(capsys, "--workers", "2", "--timeout", "60",
                                 "--failure-grace", "30", "--", sys.executable, "-c", program)
    assert "[worker 0] noticed" in out, out  # it ran on after worker 1 failed
    assert code == 5  # its own exit code counts: it ended by itself
    assert seconds < 20  # the grace ends when every task has ended
    assert cli.main(["launch", "--failure-grace", "-1", "--", "true"]) == 2


def test_a_hanging_task_is_killed_by_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, seconds = _launch(capsys, "--workers", "2", "--timeout", "2", "--",
                                 sys.executable, "-c", "import time; time.sleep(60)")
    assert code == 124
    assert "[launch] timeout after 2 s" in out
    assert seconds < 20


def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["launch", "--workers", "0", "--", "true"]) == 2
    assert cli.main(["launch", "--workers", "1"]) == 2
    assert "give the command after --" in capsys.readouterr().err
