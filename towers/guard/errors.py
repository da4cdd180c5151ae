"""The errors towers raises for its own failures: a :class:`TowersError` and a built-in."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["AlgorithmError", "CheckpointError", "NonFiniteError", "ReplicaMismatchError",
           "StepTimeout", "TowersError"]  # fmt: skip


class TowersError(Exception):
    """Base class of the errors towers raises itself."""


class NonFiniteError(TowersError, FloatingPointError):
    """A step met a NaN or Inf (``on_nonfinite="raise"``); nothing was updated.

    Attributes:
        step: the optimizer's iteration count when the step ran (it did not advance).
        towers: ``{tower: what was non-finite}``, e.g. ``{1: ["loss", "gradients"]}``.
        variable: the variable whose *update* overflowed from finite inputs, else None.
    """

    def __init__(self, step: int, towers: dict[int, list[str]], devices: Sequence[str],
                 variable: str | None = None) -> None:  # fmt: skip
        self.step, self.towers, self.variable = step, towers, variable
        where = "; ".join(
            f"tower {i} ({devices[i]}): {', '.join(what)}" for i, what in sorted(towers.items()))
        if variable is not None:
            where = (f"the optimizer's update of {variable} (its gradients were finite; "
                     "a learning rate or epsilon that overflows?)")
        where = where or "on another process's towers (this one's were finite)"
        super().__init__(
            f"step {step}: non-finite values on {len(towers)} tower(s) — {where}. Nothing was "
            "updated (weights, optimizer slots and iterations, state and all-reduce state are "
            "as before the step). Look for NaN/Inf in that tower's shard of x or y, a too high "
            "learning rate, or pass on_nonfinite='skip' to drop such steps and go on.")


class StepTimeout(TowersError, TimeoutError):
    """A step ran past its deadline (``step_timeout``, ``timeout_seconds`` or an op timeout).

    Attributes:
        algorithm: the all-reduce's name.
        seconds: the step's deadline (None: a user's collective's own op timeout fired).
        usable: whether the trainer can run another step in this process.
        earlier: the earlier step's timed-out collective this step failed at once for.
        applied: the step's update began (do not retry it); False: it changed nothing.
        partly: the update was cut short: some variables, slots or ``iterations`` moved.
    """

    def __init__(self, algorithm: str, seconds: float | None, usable: bool, detail: str,
                 earlier: str | None = None, *, applied: bool = False,
                 partly: bool = False) -> None:  # fmt: skip
        self.algorithm, self.seconds, self.usable = algorithm, seconds, usable
        self.earlier, self.applied, self.partly = earlier, applied, applied and partly
        within = f"within {seconds:g} s" if seconds else "within its collectives' op timeout"
        if self.partly:
            what = ("was cut short after its update began: the step WAS applied in part (do "
                    "not retry it; some variables, optimizer slots or iterations moved and the "
                    "replicas may disagree)")  # fmt: skip
        elif applied:
            what = (f"completed only as its deadline of {seconds or 0:g} s passed: the step WAS "
                    "applied (do not retry it; weights, optimizer state and iterations include "
                    "it)")  # fmt: skip
        elif earlier:
            what = (f"failed at once: an earlier step timed out ({earlier}) and TensorFlow "
                    "aborts every later collective op in the process; the step changed nothing")
        else:
            what = (f"did not complete {within}: a collective never completed (a tower or peer "
                    "missing, or group keys or sizes that do not match); the step changed "
                    "nothing")  # fmt: skip
        after = "The trainer is still usable." if usable else (
            "No collective op can run in this process any more (TensorFlow aborts them all "
            "after a timeout): restart the process and resume from a checkpoint.")
        super().__init__(f"the step with all-reduce {algorithm!r} {what}. {after} [{detail}]")


class AlgorithmError(TowersError, ValueError):
    """An all-reduce algorithm broke its contract (traced, or checked at construction).

    Attributes:
        algorithm: its registry name or ``__name__``.
        tower: the tower whose output is wrong (None: the output list itself).
        variable: the variable whose gradient it was reducing.
    """

    def __init__(self, algorithm: str, tower: int | None, variable: str, expected: str,
                 got: str, hint: str | None = None) -> None:  # fmt: skip
        self.algorithm, self.tower, self.variable = algorithm, tower, variable
        where = "its outputs" if tower is None else f"output {tower} (tower {tower})"
        hint = hint or ("An algorithm returns one tensor per input, output i with input i's "
                        "shape and dtype, on input i's device (see "
                        "towers.allreduce.machinery.base).")  # fmt: skip
        super().__init__(f"all-reduce algorithm {algorithm!r} broke the contract reducing "
                         f"{variable}: {where} should be {expected}, got {got}. {hint}")


class ReplicaMismatchError(TowersError, RuntimeError):
    """Replicas that must be bitwise equal differ (``check_replicas_every``).

    Attributes:
        step: the optimizer's iteration count when the check ran.
        variable: the first variable whose copies differ.
        replicas: the replicas (towers) whose copy differs from replica 0's.
    """

    def __init__(self, step: int, variable: str, replicas: list[int], algorithm: str) -> None:
        self.step, self.variable, self.replicas = step, variable, replicas
        super().__init__(
            f"step {step}: the replicas' copies of {variable} differ — replica(s) "
            f"{replicas} disagree with replica 0. Every replica applies the all-reduced "
            f"gradient, so they must stay bitwise equal: the all-reduce {algorithm!r} "
            "probably does not give every tower the same sum (check it with "
            "towers.testing.check_all_reduce).")


class CheckpointError(TowersError, ValueError):
    """A checkpoint (``path``, its prefix) is missing, truncated, corrupt or another's."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"checkpoint {path!r}: {reason}")
