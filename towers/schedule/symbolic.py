"""Prove a schedule correct without TensorFlow: follow sets of contributions, tick by tick.

Each slot ``(tower, chunk)`` carries the *set* of towers whose inputs it sums (a bit mask),
its summation tree (up to commutativity) and that tree's depth. Tower ``t`` starts with
``{t}`` in every chunk; for ``all_gather`` and ``broadcast`` the owner of chunk ``c`` starts
with it *complete*, the others with nothing. The rules, checked step by step:

1. a step names towers and chunks in range, and no tower sends to itself;
2. **send before receipt**: a ``reduce`` sends a chunk its source holds; a ``copy``
   one its source holds *complete* (a copy replaces the destination's slot);
3. **double count**: a ``reduce`` never adds a contribution the destination has;
4. a ``copy`` is the only write to its slot in its tick;
5. at the end (**dropped chunk**): every tower holds every chunk complete, in one
   summation tree per chunk (outputs agree bitwise); ``reduce_scatter``: each owner.

:func:`check_schedule` reports the smallest failing ``n``, the first tick that breaks a
rule and the state at that tick, drawn.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable

from towers.schedule.ir import Generator, Schedule, Step

__all__ = ["ScheduleError", "ScheduleReport", "check_schedule", "simulate", "summation_depth"]

MAX_DRAWN = 12  # towers / chunks drawn in full; beyond, the ones involved and the ends


class ScheduleError(ValueError):
    """A schedule broke a rule at ``tick`` (``num_ticks`` and ``end`` for the end state; None:
    the generator failed) at ``n`` towers (set by :func:`check_schedule`)."""

    def __init__(self, tick: int | None, message: str, drawing: str, *, end: bool = False,
                 n: int = 0) -> None:  # fmt: skip
        where = ("the generator" if tick is None else f"tick {tick}" if not end
                 else f"after tick {tick - 1} (the end)" if tick else "at the end (no ticks)")
        super().__init__(f"{where}: {message}")
        self.tick, self.message, self.drawing, self.end, self.n = tick, message, drawing, end, n


@dataclasses.dataclass
class _State:
    have: list[list[int]]  # have[tower][chunk]: bit t set when tower t's input is summed in
    tree: list[list[int]]  # an id per distinct summation tree (0: empty slot)
    depth: list[list[int]]
    nodes: dict[tuple[int, int], int]  # (left id, right id), sorted -> id

    def join(self, a: int, b: int) -> int:  # a new node's id is negative: never a leaf's
        return self.nodes.setdefault((min(a, b), max(a, b)), -(len(self.nodes) + 1))


def _initial(s: Schedule) -> _State:
    n, k, full = s.towers, s.chunks, (1 << s.towers) - 1
    if s.collective in ("all_gather", "broadcast"):
        have = [[full if s.chunk_owner(c) == t else 0 for c in range(k)] for t in range(n)]
        tree = [[c + 1 if h else 0 for c, h in enumerate(row)] for row in have]
    else:
        have = [[1 << t] * k for t in range(n)]
        tree = [[t + 1] * k for t in range(n)]
    return _State(have, tree, [[0] * k for _ in range(n)], {})


def _members(mask: int, n: int) -> str:
    """The towers in ``mask`` as runs (``0-2,5``): ``all``, or ``·`` for none."""
    if mask == (1 << n) - 1:
        return "all"
    bits = [t for t in range(n) if mask >> t & 1]
    runs = [[b for _, b in run] for _, run in itertools.groupby(enumerate(bits),
                                                                lambda ib: ib[1] - ib[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "·"


def _shown(total: int, involved: Iterable[int]) -> list[int]:
    if total <= MAX_DRAWN:
        return list(range(total))
    return sorted({0, 1, total - 1} | {i for i in involved if 0 <= i < total})


def draw_state(s: Schedule, state: _State, tick: int, bad: Step | None = None) -> str:
    """The contributions every tower holds per chunk when ``tick`` begins, and its steps."""
    towers = _shown(s.towers, [] if bad is None else [bad.src, bad.dst])
    chunks = _shown(s.chunks, [] if bad is None else [bad.chunk])
    cells = [[_members(state.have[t][c], s.towers) for c in chunks] for t in towers]
    width = max(4, *(len(cell) for row in cells for cell in row))
    if tick >= s.num_ticks:
        held = f"after tick {tick - 1}, the last" if tick else "at the end (no ticks)"
    else:
        held = f"after tick {tick - 1}, when tick {tick} begins" if tick else "when tick 0 begins"
    lines = [f"{s.name}, n={s.towers}: contributions held {held} (· none)"]
    lines.append("         " + " ".join(f"c{c}".rjust(width) for c in chunks))
    lines += [f"tower {t:<3}" + " ".join(x.rjust(width) for x in row)
              for t, row in zip(towers, cells)]
    if tick < s.num_ticks:
        steps = s.ticks[tick]
        marks = [("✗ " if step == bad else "") + _step_text(step) for step in steps[:16]]
        more = f"  … {len(steps) - 16} more" if len(steps) > 16 else ""
        lines.append(f"tick {tick}: " + "   ".join(marks) + more)
    return "\n".join(lines)


def _step_text(step: Step) -> str:
    return f"{step.src} ─c{step.chunk}{'+' if step.kind == 'reduce' else ''}▶ {step.dst}"


def _read(s: Schedule, state: _State, tick: int, step: Step) -> None:
    """Rules 1 and 2 for one step, against the state the tick began with."""
    n, full = s.towers, (1 << s.towers) - 1
    if not (0 <= step.src < n and 0 <= step.dst < n and 0 <= step.chunk < s.chunks):
        why = f"step {tuple(step)} names a tower or chunk out of range ({n} towers, "
        raise ScheduleError(tick, why + f"{s.chunks} chunks)", draw_state(s, state, tick))
    if step.src == step.dst:
        raise ScheduleError(tick, f"tower {step.src} sends chunk {step.chunk} to itself",
                            draw_state(s, state, tick, step))
    held = state.have[step.src][step.chunk]
    if not held or (step.kind == "copy" and held != full):
        what = "any of it" if not held else f"it complete (only {_members(held, n)})"
        verb = "copies" if step.kind == "copy" else "reduces"
        why = (f"send before receipt: tower {step.src} {verb} chunk {step.chunk} to "
               f"tower {step.dst} but does not hold {what}")
        raise ScheduleError(tick, why, draw_state(s, state, tick, step))


def _tick(s: Schedule, state: _State, tick: int) -> None:
    """One tick, in place: read every source as the tick began, then write (rules 1-4)."""
    steps = s.ticks[tick]
    for step in steps:
        _read(s, state, tick, step)
    sent = [(state.have[st.src][st.chunk], state.tree[st.src][st.chunk],
             state.depth[st.src][st.chunk]) for st in steps]
    writes: dict[tuple[int, int], Step] = {}
    pending: dict[tuple[int, int], tuple[int, int, int]] = {}
    for step, (have, tree, depth) in zip(steps, sent):
        slot = (step.dst, step.chunk)
        earlier = writes.setdefault(slot, step)
        if earlier is not step and "copy" in (earlier.kind, step.kind):
            why = (f"two writes to tower {step.dst}'s chunk {step.chunk} in one tick, one a "
                   f"copy: {_step_text(earlier)} and {_step_text(step)}")
            raise ScheduleError(tick, why, draw_state(s, state, tick, step))
        mine, own, deep = pending.get(slot) or (
            state.have[slot[0]][slot[1]], state.tree[slot[0]][slot[1]],
            state.depth[slot[0]][slot[1]])
        if step.kind == "reduce" and mine:
            if mine & have:
                why = (f"double count: tower {step.src} reduces chunk {step.chunk} into tower "
                       f"{step.dst}, which already has {_members(mine & have, s.towers)}")
                raise ScheduleError(tick, why, draw_state(s, state, tick, step))
            have, tree, depth = have | mine, state.join(tree, own), max(depth, deep) + 1
        pending[slot] = (have, tree, depth)
    for (t, c), (have, tree, depth) in pending.items():  # written once all steps are read
        state.have[t][c], state.tree[t][c], state.depth[t][c] = have, tree, depth


def _final(s: Schedule, state: _State) -> None:
    """Rule 5: the collective's promise holds after the last tick."""
    n, full, end = s.towers, (1 << s.towers) - 1, s.num_ticks
    for c in range(s.chunks):
        towers = [s.chunk_owner(c)] if s.collective == "reduce_scatter" else range(n)
        for t in towers:
            if state.have[t][c] != full:
                missing = _members(full & ~state.have[t][c], n)
                why = f"dropped chunk: tower {t} ends with chunk {c} missing {missing}"
                raise ScheduleError(end, why, draw_state(s, state, end), end=True)
        trees = {state.tree[t][c] for t in towers}
        if len(trees) > 1:
            first = next(iter(towers))
            other = next(t for t in towers if state.tree[t][c] != state.tree[first][c])
            why = (f"chunk {c} ends summed in {len(trees)} different orders across towers: "
                   f"the outputs would not agree bitwise: tower {first} sums "
                   f"{_order(state, state.tree[first][c])}, tower {other} sums "
                   f"{_order(state, state.tree[other][c])}")
            raise ScheduleError(end, why, draw_state(s, state, end), end=True)


def _order(state: _State, tree: int, limit: int = 160) -> str:
    """A summation tree as tower numbers, e.g. ``(0+1)+(2+3)`` (cut at ``limit``)."""
    parts = {node: pair for pair, node in state.nodes.items()}

    def text(t: int) -> tuple[int, str]:  # (smallest leaf, text); each leaf appears once
        if t not in parts:
            return t - 1, str(t - 1)
        halves = sorted(text(half) for half in parts[t])
        return halves[0][0], "+".join(x if x.isdigit() else f"({x})" for _, x in halves)

    out = text(tree)[1]
    return out if len(out) <= limit else out[: limit - 1] + "…"


def simulate(schedule: Schedule) -> list[list[int]]:
    """Run ``schedule`` symbolically: ``depth[tower][chunk]`` of every final slot, or a
    :class:`ScheduleError` for the first broken rule."""
    state = _initial(schedule)
    for tick in range(schedule.num_ticks):
        _tick(schedule, state, tick)
    _final(schedule, state)
    return state.depth


def summation_depth(schedule: Schedule) -> int:
    """The most additions any result element goes through (the error bound's ``k``)."""
    return max(max(row) for row in simulate(schedule))


@dataclasses.dataclass(frozen=True, repr=False)
class ScheduleReport:
    """What :func:`check_schedule` found; ``bool(report)`` is ``report.ok``."""

    name: str
    ns: tuple[int, ...]
    failure: ScheduleError | None
    depths: dict[int, int]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.failure is None

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        span = f"n={self.ns[0]}..{self.ns[-1]}" if self.ns else "no n"
        if self.failure is None:
            deepest = max(self.depths.items(), key=lambda kv: kv[1], default=(0, 0))
            return (f"PROVED: {self.name} for {len(self.ns)} tower counts ({span}) in "
                    f"{self.seconds:.2f} s; deepest sum {deepest[1]} (n={deepest[0]})")
        f = self.failure
        return f"REJECTED: {self.name}: smallest failing n={f.n}, {f}\n{f.drawing}"

    __repr__ = __str__


def check_schedule(generator: Generator, ns: Iterable[int] = range(1, 65)) -> ScheduleReport:
    """Prove ``generator(n)`` keeps its collective's promise for every ``n`` in ``ns``
    (ascending); the report holds the first failure drawn, or the depth per ``n``.

    Example:
        >>> print(check_schedule(ring_schedule, range(1, 9)))   # doctest: +SKIP
        PROVED: ring for 8 tower counts (n=1..8) in 0.01 s; deepest sum 7 (n=8)
    """
    start, counts, depths = time.perf_counter(), sorted(set(ns)), {}
    name, failure = str(getattr(generator, "__name__", generator)), None
    for n in counts:
        try:
            schedule = generator(n)
            if schedule.towers != n:
                raise ValueError(f"asked for {n} towers, the schedule has {schedule.towers}")
        except (ValueError, TypeError) as err:
            failure = ScheduleError(None, f"{type(err).__name__}: {err}", "", n=n)
            break
        name = schedule.name
        try:
            depths[n] = summation_depth(schedule)
        except ScheduleError as err:
            failure, err.n = err, n
            break
    return ScheduleReport(name, tuple(counts), failure, depths, time.perf_counter() - start)
