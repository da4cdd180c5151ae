"""What a comparison of two steps found: per-variable rows, the first divergence, the report."""

from __future__ import annotations

import dataclasses
import textwrap

__all__ = ["BisectReport", "Difference", "Divergence"]


@dataclasses.dataclass(frozen=True)
class Difference:
    """One variable's largest difference at one step, and the bound it is held to.

    ``towers`` is the run's tower count (or a label); ``worst`` the flat index with the
    largest ``diff / bound`` (``worst_diff`` and ``bound`` are there); ``cause``, when not
    ``ok``: the part that left its own bound, ``"reduction (…)"`` or ``"kernels"``.
    """

    towers: int | str
    step: int
    variable: str
    index: int
    max_diff: float
    worst: int
    worst_diff: float
    bound: float
    ok: bool
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two runs first part: the step, the variable and the first element outside.

    ``element`` is the first flat index outside, ``value_a``/``value_b`` its values, ``diff``
    and ``bound`` there; ``chunk = (k, pieces, lo, hi)``: it lies in chunk ``k`` (elements
    ``lo..hi−1``) of B's pad-split; ``compared``: ``"gradient"`` or ``"update"``; ``cause``:
    which part left its bound; ``causes``: ``"name: why"`` for each cause the batches and
    sides show; ``setting``: the one that reproduces MirroredStrategy's semantics, or "".
    """

    step: int
    variable: str
    index: int
    element: int
    value_a: float
    value_b: float
    diff: float
    bound: float
    chunk: tuple[int, int, int, int]
    compared: str
    cause: str = ""
    bound_name: str = ""
    causes: tuple[str, ...] = ()
    setting: str = ""


@dataclasses.dataclass(frozen=True)
class BisectReport:
    """What ``compare`` or ``bisect`` (``kind``) found: ``first`` is None when every step
    stayed within ``bound``, which says which bound was used and why."""

    a: str
    b: str
    towers: int
    rows: tuple[Difference, ...]
    first: Divergence | None
    bound: str = ""
    kind: str = "bisect"

    @property
    def ok(self) -> bool:
        """No step left the bound."""
        return self.first is None

    @property
    def step(self) -> int | None:
        """The first divergence's step (from 1), or None."""
        return None if self.first is None else self.first.step

    @property
    def variable(self) -> str | None:
        """The first divergence's variable path, or None."""
        return None if self.first is None else self.first.variable

    def __str__(self) -> str:
        steps = max((r.step for r in self.rows), default=0)
        lines = [f"{self.kind} {self.a} (A, teacher) vs {self.b} (B), {self.towers} towers, "
                 f"{steps} step(s) checked from the same weights"]  # fmt: skip
        if self.bound:
            lines.append(f"bound: {self.bound}")
        for step in range(1, steps + 1):
            rows = [r for r in self.rows if r.step == step]
            verdict = "ok" if all(r.ok for r in rows) else "OUTSIDE"
            lines.append(f"  step {step}: max |Δ| {max(r.max_diff for r in rows):.3g}  {verdict}")
        d = self.first
        if d is None:
            lines.append("PASS: no step left the bound")
            return "\n".join(lines)
        k, pieces, lo, hi = d.chunk
        lines += [
            f"FIRST DIVERGENCE: step {d.step}, variable {d.variable} (#{d.index}, {d.compared}"
            + (f"; {d.cause})" if d.cause else ")"),
            f"  element {d.element}" + (f" (chunk {k} of {pieces}: elements {lo}..{hi - 1})"
                                        if pieces > 1 else ""),
            f"  A = {d.value_a!r}  B = {d.value_b!r}  |Δ| = {d.diff:.3g} > bound {d.bound:.3g}",
        ]
        if d.bound_name:
            lines.append(f"  bound used: {d.bound_name}")
        return "\n".join(lines + _causes(d))


def _causes(d: Divergence) -> list[str]:
    """The possible causes and the setting, wrapped to the report's width."""
    if not d.causes and not d.setting:
        return []
    lines = ["  possible causes, read from the batches and both sides (towers.testing.causes):"]
    for cause in d.causes:
        lines += textwrap.wrap(cause, 96, initial_indent="    - ", subsequent_indent="      ")
    if d.setting:
        lines += textwrap.wrap(d.setting, 96, initial_indent="  the setting: ",
                               subsequent_indent="    ")  # fmt: skip
    return lines
