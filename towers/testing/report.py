"""What a comparison of two steps found: per-step rows and the first divergence.

``compare`` and ``bisect`` (:mod:`towers.testing.compare`, :mod:`towers.testing.bisect`)
fill a :class:`BisectReport`; its ``str`` is the report a test or the CLI prints::

    bisect A (A, teacher) vs B (B), 4 towers, 3 step(s) checked from the same weights
    bound: sgd_step_bound (plain SGD: …)
      step 1: max |Δ| 2.9e-09  ok
      step 2: max |Δ| 0.0041  OUTSIDE
    FIRST DIVERGENCE: step 2, variable dense/bias (#1, update)
      element 3 (chunk 0 of 1: elements 0..5)
      A = 0.25  B = 0.2459  |Δ| = 0.0041 > bound 1.2e-08
      bound used: …
      possible causes, read from the batches and both sides (towers.testing.causes):
        - uneven batch: step 2's batch of 10 splits 3+3+3+1 over 4 towers, …
      the setting: TowerTrainer(..., semantics="mirrored") …
"""

from __future__ import annotations

import dataclasses
import textwrap

from towers.testing.onestep import Difference

__all__ = ["BisectReport", "Divergence"]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two runs first part: the step, the variable and the first element outside.

    Attributes:
        step: the step, counted from 1.
        variable: the variable's path; ``index`` its place in model order.
        element: the first flat index outside the bound.
        value_a, value_b: that element in both runs (gradients, or weights after the step).
        diff, bound: ``|value_a − value_b|`` and the bound there.
        chunk: ``(k, pieces, lo, hi)``: the element lies in chunk ``k`` of ``pieces``
            (flat elements ``lo..hi−1``) when B's algorithm splits the variable with
            ``pad_split`` into ``n·subchunks`` pieces (ring, halving-doubling, …).
        compared: ``"gradient"`` or ``"update"`` (one SGD step, against a reference).
        cause: gradients only: which part left its own bound (``"reduction (B)"``,
            ``"reduction (reference)"`` for A, or ``"kernels"``: the towers' inputs differ).
        bound_name: which bound held the step, and why that one (see :class:`BisectReport`).
        causes: what the batches and the two sides show that may explain it, one
            ``"name: why"`` each (:mod:`towers.testing.causes`); empty when nothing does.
        setting: the setting that reproduces MirroredStrategy's semantics, when a cause
            is them; else "".
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
    """What ``compare`` or ``bisect`` found: ``first`` is None when every step stayed within
    bound; ``bound`` says which bound was used and why; ``kind`` which function ran."""

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
        """The first divergence's step (from 1), or None (the contract's ``report.step``)."""
        return None if self.first is None else self.first.step

    @property
    def variable(self) -> str | None:
        """The first divergence's variable path, or None (the contract's ``report.variable``)."""
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
