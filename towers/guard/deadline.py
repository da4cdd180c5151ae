"""A step's deadline: no step hangs, and a timed-out collective is a ``StepTimeout``.

::

    train_step ─▶ trace (untimed) ─▶ run ───────────────▶ result
                                      │ step_timeout s pass first
                                      ▼
                          watchdog: abort_collective_ops(DEADLINE_EXCEEDED)
                                      │ every pending collective fails
                                      ▼
           tf.errors.DeadlineExceededError (op timeout or watchdog) ─▶ StepTimeout
           tf.errors.UnavailableError (a peer lost mid-transfer)    ─▶ StepTimeout
           tf.errors.CancelledError, after an abort                 ─▶ StepTimeout

One process-wide watchdog thread (:func:`watched`), no op timeouts: TensorFlow keeps one
thread asleep per collective op for its whole ``timeout=``, which ran small models out
of threads (docs/reliability.md). A step's deadline is ``step_timeout``, else the
algorithm's own ``timeout_seconds`` (the ``nccl`` family, :mod:`towers.cluster`'s
reducers), else none; past it, the watchdog calls ``abort_collective_ops``, as
``MultiWorkerMirroredStrategy``'s peer health check does. The step is traced before the
clock starts, so a slow first trace never trips it.

An aborted collective aborts every later one in the process, so a ``StepTimeout`` says:
restart and resume from a checkpoint. The update waits for every reduced value
(``TowerTrainer._update``), so a hang before it changes nothing (``applied`` False); the
update sets :attr:`Deadline.began` first, so a hang inside it, or a step that completed
as the watchdog fired, says ``applied=True`` and is not retried. A hang outside
collective ops (a ``py_function`` that never returns) cannot be aborted this way.

    hang planted in     forward   reduce    apply (an owner)   all-gather   none (watchdog)
    StepTimeout.applied False     False     True, in part      True, in part True
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context

from towers.guard.arguments import positive_float
from towers.guard.errors import StepTimeout

__all__ = ["Alarm", "Deadline", "watched", "within"]

_TIMED_OUT: list[str] = []
"""The process's timed-out steps: TensorFlow's collective abort is process-wide too."""


class Deadline:
    """A trainer's step deadline.

    Args:
        seconds: the deadline of one step's execution (``step_timeout``, else the
            algorithm's ``timeout_seconds``), or None: no watchdog.
        name: the all-reduce's name, for errors.
        device: where :attr:`began` lives (None: TensorFlow's default).

    Attributes:
        began: a boolean variable the step sets as its update begins (``towers.step``),
            cleared before each run: a failed step applied (in part) ⇔ it is set.
    """

    def __init__(self, seconds: float | None, name: str, device: str | None = None) -> None:
        self.seconds, self.name = seconds, name
        self._alarm: Alarm | None = None  # the watchdog's alarm of the step now running
        self._traced: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()
        with tf.init_scope(), tf.device(device):
            self.began = tf.Variable(False, trainable=False, name="update_began")

    def run(self, step: Any, inputs: tuple[Any, ...]) -> Any:
        """``step(*inputs)`` within the deadline.

        Raises:
            StepTimeout: a collective did not complete (its op timeout, the watchdog,
                an earlier timeout that aborted collectives in this process, or a peer
                lost in the middle of a transfer, or a node cancelled with the aborted
                collectives; the step changed nothing), or the step
                completed just as the watchdog fired (``applied=True``: it must not be
                retried).
        """
        self.began.assign(False)
        try:
            if self.seconds is None:
                return step(*inputs)
            self._trace(step, inputs)
            return self._watched(step, inputs)
        except tf.errors.DeadlineExceededError as err:
            lines = [ln.strip() for ln in str(err.message).splitlines()]
            said = [ln for ln in lines if any(k in ln for k in ("aborted", "timed out", "eadline"))]
            raise self._timeout((said or lines)[-1][:200]) from None
        except tf.errors.CancelledError as err:
            # Once collectives are aborted, the executor may report a node that was
            # cancelled with them (an Assert beside the collective, measured in CI)
            # instead of the collective's own DEADLINE_EXCEEDED: the same fault. A
            # cancellation with no abort behind it is not a timeout and is raised as is.
            if not (_TIMED_OUT or (self._alarm and self._alarm.fired)):
                raise
            lines = [ln.strip() for ln in str(err.message).splitlines() if ln.strip()]
            raise self._timeout(f"cancelled with the aborted collectives: "
                                f"{lines[-1][:200] if lines else err}") from None
        except tf.errors.UnavailableError as err:
            # A peer lost in the middle of a transfer ("Socket closed" on a RecvBuf) fails
            # the collective at once instead of letting it time out: the same fault, the
            # same remedy (restart, resume), and the step function did not return.
            lines = [ln.strip() for ln in str(err.message).splitlines() if ln.strip()]
            raise self._timeout(f"a peer was lost: {lines[0][:200] if lines else err}") from None

    def _trace(self, step: Any, inputs: tuple[Any, ...]) -> None:
        """Trace ``step`` for ``inputs`` before the clock starts (a slow first trace must not
        trip the deadline); a signature seen before skips the lookup (0.2 ms a step)."""
        flat = tf.nest.flatten(inputs)
        signature = tuple((tuple(x.shape), x.dtype) if hasattr(x, "dtype") else x for x in flat)
        seen = self._traced.setdefault(step, set())
        if signature not in seen:
            step.get_concrete_function(*inputs)
            seen.add(signature)

    def _timeout(self, detail: str, completed: bool = False) -> StepTimeout:
        """The step's error; a step that failed is applied in part if its update began."""
        earlier = _TIMED_OUT[0] if _TIMED_OUT else None
        _TIMED_OUT.append(f"all-reduce {self.name!r}")
        applied = completed or bool(self.began.numpy())
        return StepTimeout(self.name, self.seconds, False, detail, earlier, applied=applied,
                           partly=applied and not completed)  # fmt: skip

    def _watched(self, step: Callable[..., Any], inputs: tuple[Any, ...]) -> Any:
        message = f"towers: the step's deadline of {self.seconds:g} s passed ({self.name})"
        with watched(float(self.seconds or 0), message) as self._alarm:
            result = step(*inputs)
        if self._alarm.fired:
            # The step returned, so its update ran (the apply phase is part of the step),
            # but the watchdog aborted the process's collectives as it finished: an error,
            # and one that says the step was applied, so a retry does not apply it twice.
            raise self._timeout(f"{message}; the step had completed", completed=True)
        return result


class Alarm:
    """One deadline armed by :func:`watched`; ``fired`` once the watchdog acted on it."""

    def __init__(self, due: float, message: str) -> None:
        self.due, self.message, self.fired = due, message, False


_WATCH = threading.Condition()
_ARMED: set[Alarm] = set()
_WATCHER: list[threading.Thread] = []


@contextlib.contextmanager
def watched(seconds: float, message: str) -> Iterator[Alarm]:
    """Run the body within ``seconds``: past them, every collective op in the process is
    aborted with ``message`` (a collective waiting for a peer fails instead of hanging).

    One daemon thread serves every alarm of the process. Once the body has left, its
    alarm can no longer fire: ``alarm.fired`` is then final.

    Raises:
        ValueError: ``seconds`` is not a number > 0 (``float("inf")``: never fires).
    """
    alarm = Alarm(time.monotonic() + positive_float("seconds", seconds), message)
    with _WATCH:
        if not (_WATCHER and _WATCHER[0].is_alive()):
            _WATCHER[:] = [threading.Thread(target=_watch, name="towers-watchdog", daemon=True)]
            _WATCHER[0].start()
        _ARMED.add(alarm)
        _WATCH.notify()
    try:
        yield alarm
    finally:
        with _WATCH:
            _ARMED.discard(alarm)


def _watch() -> None:
    """The watchdog: sleep until the earliest alarm is due, fire every due one, repeat."""
    with _WATCH:
        while True:
            now = time.monotonic()
            for alarm in [a for a in _ARMED if a.due <= now]:
                _ARMED.discard(alarm)
                alarm.fired = True
                _abort_collectives(alarm.message)
            # at most an hour at a time: a deadline of float("inf") is a wait too long to pass
            _WATCH.wait(min([a.due - now for a in _ARMED] + [3600.0]))


def within(seconds: float, fn: Callable[[], Any], message: str) -> Any:
    """``fn()``, or ``TimeoutError(message)`` once ``seconds`` pass without it returning.

    ``fn`` runs on a daemon thread that the caller waits for with a deadline; on expiry
    the process's collective ops are aborted (so a hung collective fails and the thread
    ends) and the error is raised. A wait outside collectives (a queue nobody fills)
    cannot be stopped: its thread is left behind, the caller is not. What ``fn`` raises
    in time is raised here.

    Raises:
        TimeoutError: ``fn`` did not return within ``seconds``.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=run, name="towers-within", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _TIMED_OUT.append(message)
        _abort_collectives(f"towers: {message}")
        thread.join(5.0)  # let an aborted collective unwind; never wait for more
        raise TimeoutError(message)
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _abort_collectives(message: str) -> None:
    """Abort every pending and later collective op in the process (the watchdog's act)."""
    context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, message)
