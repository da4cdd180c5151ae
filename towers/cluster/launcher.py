"""Run one process per task on localhost: ``towers launch`` and local servers for a client.

Each task gets its TF_CONFIG and ``TOWERS_PER_TASK``, its lines are prefixed ``[worker k]``;
every task is its own process group, terminated (then killed) when the launch ends, and a
process a finished worker left running fails the launch (:data:`LEFTOVER_EXIT`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO

from towers.cluster.spec import TOWERS_ENV, Cluster, local_cluster, tf_config
from towers.guard.arguments import non_negative_float

__all__ = ["LEFTOVER_EXIT", "TIMEOUT_EXIT", "LocalServers", "TaskProcess", "launch",
           "poll_until", "start_servers"]

TIMEOUT_EXIT = 124  # as coreutils ``timeout``
LEFTOVER_EXIT = 1  # every task succeeded but left processes running (killed)
SERVER_COMMAND = (sys.executable, "-m", "towers.cluster.server")
_GRACE_SECONDS = 5.0


class TaskProcess:
    """One task's process; its lines are copied to ``out`` prefixed ``[job k]``."""

    def __init__(self, cluster: Cluster, job: str, index: int, towers: int,
                 command: Sequence[str], out: IO[str], lock: threading.Lock) -> None:
        self.label = f"[{job} {index}]"
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # this very towers first
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "TF_CONFIG": tf_config(cluster, job, index),
               TOWERS_ENV: str(towers), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        self.process = subprocess.Popen(
            list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
        self.killed = self.serving = False
        self._out, self._lock = out, lock
        self._reader = threading.Thread(target=self._copy, daemon=True)
        self._reader.start()

    def _copy(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.serving = self.serving or line.startswith("serving ")
            with self._lock:
                self._out.write(f"{self.label} {line.rstrip()}\n")
                self._out.flush()

    def poll(self) -> int | None:
        """The exit code (128 + signal if signalled), or None while it runs."""
        code = self.process.poll()
        return None if code is None else (128 - code if code < 0 else code)

    def stop(self) -> int:
        """Terminate (then kill) the task's group; return how many processes it left running."""
        self.killed = self.process.poll() is None
        leftover = 0 if self.killed else len(_group_members(self.process.pid))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(_GRACE_SECONDS)
            if self.process.poll() is not None and poll_until(
                    lambda: not _group_members(self.process.pid), _GRACE_SECONDS):
                break
        return leftover

    def finish(self) -> None:
        self.process.wait()
        self._reader.join(timeout=_GRACE_SECONDS)


def _group_members(pgid: int) -> list[int]:
    """Live processes of group ``pgid`` from /proc; elsewhere one if it takes signals."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp …": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def poll_until(done: Callable[[], bool], seconds: float) -> bool:
    """Whether ``done()`` came true within ``seconds`` (asked every 50 ms)."""
    until = time.monotonic() + seconds
    while not done():
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return True


def launch(cluster: Cluster, towers: int, command: Sequence[str],
           timeout: float | None = None, out: IO[str] | None = None,
           failure_grace: float = 0.0) -> int:
    """Run ``command`` once per trainer task of ``cluster`` (``towers`` CPUs each), ps
    tasks as servers; return 0, :data:`TIMEOUT_EXIT` or the largest exit code of a task."""
    non_negative_float("failure_grace", failure_grace)
    if not command:
        raise ValueError("command is empty: give the program to run after --")
    if cluster.num_workers == 0:
        raise ValueError("the cluster has no 'chief' or 'worker' task to run the command")
    out, lock = out or sys.stdout, threading.Lock()
    trainers: list[TaskProcess] = []
    servers: list[TaskProcess] = []
    for job, addresses in cluster.jobs.items():
        trains = job in ("chief", "worker")
        for k in range(len(addresses)):
            (trainers if trains else servers).append(TaskProcess(
                cluster, job, k, towers, command if trains else SERVER_COMMAND, out, lock))

    def ended() -> bool:
        return all(t.poll() is not None for t in trainers)

    def failed() -> bool:
        return any(t.poll() not in (None, 0) for t in trainers)

    until = time.monotonic() + (float("inf") if timeout is None else timeout)
    code = 0
    try:
        if not poll_until(lambda: ended() or failed(), until - time.monotonic()):
            code = TIMEOUT_EXIT
            with lock:
                out.write(f"[launch] timeout after {timeout:g} s: killing every task\n")
        elif failed():  # the others get failure_grace to finish (and report) on their own
            poll_until(ended, min(failure_grace, until - time.monotonic()))
            code = max(c for t in trainers if (c := t.poll()) is not None)
    finally:
        left = {t.label: t.stop() for t in trainers + servers}
        for task in trainers + servers:
            task.finish()
    code = code or max((c for t in trainers if not t.killed and (c := t.poll()) is not None),
                       default=0)
    for task in trainers:
        if left[task.label]:
            out.write(f"[launch] {task.label[1:-1]} exited but left {left[task.label]} "
                      "process(es) of its group running: terminated\n")
            code = code or LEFTOVER_EXIT
    for task in trainers + servers:
        if survivors := _group_members(task.process.pid):
            out.write(f"[launch] {task.label[1:-1]}: processes {survivors} survived SIGKILL\n")
            code = code or LEFTOVER_EXIT
    return code


class LocalServers:
    """The running servers: ``cluster`` and each task's process."""

    def __init__(self, cluster: Cluster, tasks: dict[tuple[str, int], TaskProcess]) -> None:
        self.cluster, self.tasks = cluster, tasks

    def stop(self, job: str, index: int) -> None:
        """Stop one task's server now (a lost ps, on purpose)."""
        self.tasks[(job, index)].stop()


@contextlib.contextmanager
def start_servers(workers: int, towers_per_worker: int, *, ps: int = 0, chief: bool = False,
                  ready_timeout: float = 60.0, out: IO[str] | None = None
                  ) -> Iterator[LocalServers]:
    """Serve ``workers`` and ``ps`` tasks on localhost in the block (``chief``: an address
    for the client itself); ``RuntimeError``: a server did not start in time."""
    cluster, lock = local_cluster(workers, ps=ps, chief=chief), threading.Lock()
    tasks = {}
    try:
        for job, towers in (("worker", towers_per_worker), ("ps", 1)):
            for k in range(len(cluster.jobs.get(job, ()))):
                tasks[(job, k)] = TaskProcess(cluster, job, k, towers, SERVER_COMMAND,
                                              out or sys.stderr, lock)
        deadline = time.monotonic() + ready_timeout
        while not all(t.serving for t in tasks.values()):
            if any(t.poll() is not None for t in tasks.values()) or time.monotonic() > deadline:
                raise RuntimeError(f"the local servers ({workers} workers, {ps} ps) did not "
                                   f"start within {ready_timeout:g} s")
            time.sleep(0.05)
        yield LocalServers(cluster, tasks)
    finally:
        for task in tasks.values():
            task.stop()
        for task in tasks.values():
            task.finish()
