"""Run one process per task on localhost: ``towers launch`` and :func:`start_servers`.

::

    launch(cluster, T, CMD)
      worker 0: CMD  (TF_CONFIG task 0, TOWERS_PER_TASK=T) ──▶ "[worker 0] line"
      worker 1: CMD  (TF_CONFIG task 1, TOWERS_PER_TASK=T) ──▶ "[worker 1] line"
      ps 0:     python -m towers.cluster.server            ──▶ "[ps 0] line"
      one task fails  → the others are terminated (after failure_grace seconds, in
                        which they may end by themselves); --timeout → all are killed (124)

Trainers (chief and worker tasks) run the command; parameter servers serve until the
trainers are done. Every task is its own process group, so ending a task ends whatever it
started: when the launch ends, every task's whole group is terminated (then killed),
also when the task itself already exited — a process a worker left running fails the
launch (:data:`LEFTOVER_EXIT`), named in a ``[launch]`` line. (A process that leaves the
group with ``setsid`` is out of any launcher's reach.) Each task imports the launcher's
own ``towers`` (PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import IO, Protocol

from towers.cluster.local import TOWERS_ENV, local_cluster
from towers.cluster.spec import Cluster, tf_config
from towers.guard.arguments import non_negative_float

__all__ = ["LEFTOVER_EXIT", "TIMEOUT_EXIT", "Sink", "TaskProcess", "launch", "start_servers"]

TIMEOUT_EXIT = 124
"""Exit code of a launch that ran past its timeout (as coreutils ``timeout``)."""
LEFTOVER_EXIT = 1
"""Exit code of a launch whose tasks all succeeded but left processes running (killed)."""
SERVER_COMMAND = (sys.executable, "-m", "towers.cluster.server")
_GRACE_SECONDS = 5.0


class Sink(Protocol):
    """Where prefixed output lines go: any text stream."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class TaskProcess:
    """One task's process; its output lines are copied to ``out`` prefixed ``[job k]``."""

    def __init__(self, cluster: Cluster, job: str, index: int, towers: int,
                 command: Sequence[str], out: Sink, lock: threading.Lock) -> None:
        self.job, self.index, self.label = job, index, f"[{job} {index}]"
        env = {**os.environ, "TF_CONFIG": tf_config(cluster, job, index),
               TOWERS_ENV: str(towers), "PYTHONUNBUFFERED": "1", "PYTHONPATH": _python_path()}
        self.process = subprocess.Popen(
            list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True,
        )
        self.killed = False
        self._out, self._lock = out, lock
        self._reader = threading.Thread(target=self._copy, daemon=True)
        self._reader.start()

    def _copy(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._lock:
                self._out.write(f"{self.label} {line.rstrip()}\n")
                self._out.flush()

    def poll(self) -> int | None:
        """The exit code (128 + signal for a signalled process), or None while it runs."""
        code = self.process.poll()
        return None if code is None else (128 - code if code < 0 else code)

    def stop(self) -> int:
        """Terminate the task's whole process group, the task's own process first; kill
        what is left after a grace period. Returns how many processes the group still
        held after the task itself had exited (left running by it)."""
        if self.process.poll() is None:
            self.killed = True
            leftover = 0
        else:
            leftover = len(_group_members(self.process.pid))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(_GRACE_SECONDS)
            if self.process.poll() is not None and _wait_group_empty(self.process.pid):
                break
        return leftover

    def survivors(self) -> list[int]:
        """Processes of the task's group still alive (after :meth:`stop`)."""
        return _group_members(self.process.pid)

    def finish(self) -> None:
        """Wait for the output to be copied (after the process ended)."""
        self.process.wait()
        self._reader.join(timeout=_GRACE_SECONDS)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``, read from /proc (Linux);
    elsewhere one placeholder when the group still accepts signals."""
    proc = "/proc"
    if not os.path.isdir(proc):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp …": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def _wait_group_empty(pgid: int, seconds: float = _GRACE_SECONDS) -> bool:
    """Whether group ``pgid`` has no live process left within ``seconds``."""
    until = time.monotonic() + seconds
    while _group_members(pgid):
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return True


def _python_path() -> str:
    """PYTHONPATH that imports this very ``towers`` first (a task must run the launcher's code)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([root, rest]) if rest else root


def _start_all(cluster: Cluster, towers: int, command: Sequence[str], out: Sink,
               lock: threading.Lock) -> tuple[list[TaskProcess], list[TaskProcess]]:
    trainers, servers = [], []
    for job, addresses in cluster.jobs.items():
        for k in range(len(addresses)):
            if job in ("chief", "worker"):
                trainers.append(TaskProcess(cluster, job, k, towers, command, out, lock))
            else:
                servers.append(TaskProcess(cluster, job, k, towers, SERVER_COMMAND, out, lock))
    return trainers, servers


def launch(cluster: Cluster, towers: int, command: Sequence[str],
           timeout: float | None = None, out: IO[str] | None = None,
           failure_grace: float = 0.0) -> int:
    """Run ``command`` once per trainer task of ``cluster`` and return the worst exit code.

    Args:
        cluster: the cluster (e.g. :func:`towers.cluster.local_cluster`).
        towers: logical devices per task (``TOWERS_PER_TASK`` in each task's environment).
        command: the program and its arguments.
        timeout: seconds before every task is killed (None: no limit).
        out: where prefixed output lines go (default ``sys.stdout``).
        failure_grace: seconds the other trainers may run on after one failed (to
            report the failure themselves, e.g. a ``StepTimeout``) before they are
            terminated; their exit codes then count.

    Returns:
        0 when every trainer exits 0; :data:`TIMEOUT_EXIT` after a timeout; otherwise
        the largest exit code among tasks that ended by themselves (128 + signal number
        for a signalled one). Tasks terminated because another failed do not count.

    Raises:
        ValueError: an empty command, a cluster without trainers or a negative grace.
    """
    non_negative_float("failure_grace", failure_grace)
    if not command:
        raise ValueError("command is empty: give the program to run after --")
    if cluster.num_workers == 0:
        raise ValueError("the cluster has no 'chief' or 'worker' task to run the command")
    out = out or sys.stdout
    lock = threading.Lock()
    trainers, servers = _start_all(cluster, towers, command, out, lock)
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    try:
        while any(t.poll() is None for t in trainers):
            failed = [c for t in trainers if (c := t.poll()) not in (None, 0)]
            if failed:
                _wait_for(trainers, min(time.monotonic() + failure_grace,
                                        deadline if deadline is not None else float("inf")))
                code = max(c for t in trainers if (c := t.poll()) is not None)
                break
            if deadline is not None and time.monotonic() > deadline:
                code = TIMEOUT_EXIT
                with lock:
                    out.write(f"[launch] timeout after {timeout:g} s: killing every task\n")
                break
            time.sleep(0.05)
    finally:
        left = {t.label: t.stop() for t in trainers + servers}
        for task in trainers + servers:
            task.finish()
    ended = [c for t in trainers if not t.killed and (c := t.poll()) is not None]
    code = code or max(ended, default=0)
    for task in trainers:
        if left[task.label]:
            out.write(f"[launch] {task.label[1:-1]} exited but left {left[task.label]} "
                      "process(es) of its group running: terminated\n")
            code = code or LEFTOVER_EXIT
    for task in trainers + servers:
        if task.survivors():
            out.write(f"[launch] {task.label[1:-1]}: processes {task.survivors()} survived "
                      "SIGKILL\n")
            code = code or LEFTOVER_EXIT
    return code


def _wait_for(tasks: list[TaskProcess], until: float) -> None:
    """Let running tasks end by themselves until ``until`` (monotonic seconds)."""
    while any(t.poll() is None for t in tasks) and time.monotonic() < until:
        time.sleep(0.05)


@contextlib.contextmanager
def start_servers(workers: int, towers_per_worker: int, *, ready_timeout: float = 60.0,
                  out: IO[str] | None = None) -> Iterator[Cluster]:
    """Serve ``workers`` local tasks (``python -m towers.cluster.server``) while in the block.

    Args:
        workers: worker tasks, each a ``tf.distribute.Server`` process.
        towers_per_worker: logical CPUs each serves.
        ready_timeout: seconds to wait for every server to report it is serving.
        out: where their prefixed output goes (default ``sys.stderr``).

    Yields:
        The cluster (no task: this process is the client); see :func:`towers.cluster.connect`.

    Raises:
        RuntimeError: a server exited or did not start in time.
    """
    cluster = local_cluster(workers)
    lock = threading.Lock()
    watches = [ServingWatch(out or sys.stderr) for _ in range(workers)]
    tasks = [TaskProcess(cluster, "worker", k, towers_per_worker, SERVER_COMMAND, watch, lock)
             for k, watch in enumerate(watches)]
    try:
        deadline = time.monotonic() + ready_timeout
        while not all(watch.ready for watch in watches):
            if any(t.poll() is not None for t in tasks) or time.monotonic() > deadline:
                raise RuntimeError(f"the {workers} local servers did not start")
            time.sleep(0.05)
        yield cluster
    finally:
        for task in tasks:
            task.stop()
        for task in tasks:
            task.finish()


class ServingWatch:
    """A text sink that forwards lines and notes the server's "serving" line."""

    def __init__(self, out: IO[str]) -> None:
        self.out, self.ready = out, False

    def write(self, text: str) -> int:
        self.ready = self.ready or "] serving " in text
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()
