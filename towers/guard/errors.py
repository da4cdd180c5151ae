"""The errors towers raises for its own failures (each a :class:`TowersError`).

Every kind also derives from the built-in exception a caller would already catch
(``ValueError``, ``FloatingPointError``, ``TimeoutError``), so ``except ValueError``
written before these types existed keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CheckpointError", "NonFiniteError", "StepTimeout", "TowersError"]


class TowersError(Exception):
    """Base class of the errors towers raises itself."""


class NonFiniteError(TowersError, FloatingPointError):
    """A step met a NaN or Inf (``on_nonfinite="raise"``); nothing was updated.

    Attributes:
        step: the optimizer's iteration count when the step ran (it did not advance).
        towers: ``{tower: what was non-finite}``, e.g. ``{1: ["loss", "gradients"]}``.
    """

    def __init__(self, step: int, towers: dict[int, list[str]], devices: Sequence[str]) -> None:
        self.step = step
        self.towers = towers
        where = "; ".join(
            f"tower {i} ({devices[i]}): {', '.join(what)}" for i, what in sorted(towers.items())
        )
        super().__init__(
            f"step {step}: non-finite values on {len(towers)} tower(s) — {where}. Nothing was "
            "updated (weights, optimizer slots and iterations, state and all-reduce state are "
            "as before the step). Look for NaN/Inf in that tower's shard of x or y, a too high "
            "learning rate, or pass on_nonfinite='skip' to drop such steps and go on."
        )


class StepTimeout(TowersError, TimeoutError):
    """A step's collective did not complete within ``step_timeout`` seconds."""


class CheckpointError(TowersError, ValueError):
    """A checkpoint cannot be restored: missing, truncated, corrupt or of another trainer.

    Attributes:
        path: the checkpoint's path (prefix).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"checkpoint {path!r}: {reason}")
