"""The registries' one record shape, and the all-reduce registry with its configured algorithm.

A :class:`Record` describes an all-reduce (:data:`ALGORITHMS`), another collective's
algorithm, a codec or a placement, and is its factory: ``ring(subchunks=2)`` returns a
:class:`Configured`, a frozen callable that knows its record and parameters. Adding an
algorithm is one module ending in :func:`register_schedule` (formulas derived) or::

    mine = register(Algorithm("mine", _build, bytes_sent=..., summation_depth=..., cost=...))
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce
from towers.allreduce.machinery.scheduled import Scheduled
from towers.guard.arguments import positive_int
from towers.schedule import ir, symbolic
from towers.schedule.ir import Schedule

__all__ = ["ALGORITHMS", "KINDS", "Algorithm", "Coefficients", "Configured", "Record", "Registry",
           "algorithm_name", "from_schedule", "record_of", "register", "register_schedule",
           "schedule_of"]

Coefficients = tuple[float, float, float]
"""``(a, b, c)``: a time of ``a·α + b·β + c·γ`` (see :mod:`towers.bench.costmodel`)."""


def schedule_of(doc: str | None) -> str:
    """The drawn schedule of a module docstring: its first ``::`` block, dedented."""
    found = re.search(r"::[ \t]*\n((?:    .*\n|[ \t]*\n)*)", (doc or "") + "\n")
    return "\n".join(line[4:] for line in found.group(1).split("\n")).strip("\n") if found else ""


KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "codec", "placement")
"""What a :class:`Record` can describe: an all-reduce, another collective, a codec, a placement."""


@dataclasses.dataclass(frozen=True)
class Record:
    """What a registered thing is: its name, factory, formulas, schedule and flags.

    Fields a kind has no use for stay None; formulas take ``n`` (``bytes_sent``: ``n, nbytes,
    itemsize``) and the factory's parameters as keywords. ``bytes_sent`` is per tower
    (``estimated`` where opaque collectives move the data), ``summation_depth`` the error
    bound's ``k``, ``cost`` the α-β-γ coefficients, ``schedule`` the module docstring's
    drawing, ``generator`` ``(n, **params) -> Schedule`` where it is one; ``replayable``:
    the NumPy replay can follow its traced graph.
    """

    name: str
    factory: Callable[..., Any]
    bytes_sent: Callable[..., Sequence[float] | None] | None = None
    summation_depth: Callable[..., int] | None = None
    cost: Callable[..., Coefficients] | None = None
    schedule: str = ""
    estimated: bool = False
    replayable: bool = True
    kind: str = "all_reduce"
    summary: str = ""
    generator: Callable[..., Schedule] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Build it; an all-reduce comes back as a :class:`Configured`."""
        built = self.factory(*args, **kwargs)
        if self.kind != "all_reduce" or (isinstance(built, Configured) and built.algorithm is self):
            return built
        try:
            bound = inspect.signature(self.factory).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return Configured(self, built, dict(kwargs))
        bound.apply_defaults()
        return Configured(self, built, dict(bound.arguments))


Algorithm = Record
"""The record of an all-reduce (a :class:`Record` of kind ``"all_reduce"``)."""


def from_schedule(
    generator: Callable[..., Schedule],
    count: Callable[[Schedule, int, int], list[int]] = ir.bytes_sent,
    *,
    cost: Callable[..., Coefficients] | None = None,
) -> dict[str, Any]:
    """``bytes_sent``, ``summation_depth`` and ``cost`` (unless given) of a generator's
    schedules; ``count`` counts a schedule's bytes."""

    def bytes_sent(n: int, nbytes: int, itemsize: int, **params: Any) -> list[int]:
        return count(generator(n, **params), nbytes, itemsize)

    def summation_depth(n: int, **params: Any) -> int:
        return symbolic.summation_depth(generator(n, **params))

    def counted(n: int, nbytes: float, **params: Any) -> Coefficients:
        return ir.cost(generator(n, **params), nbytes)

    return {"bytes_sent": bytes_sent, "summation_depth": summation_depth,
            "cost": cost or counted, "generator": generator}


class Registry(dict[Any, Record]):
    """One registry: key -> :class:`Record` (by name, or by ``(kind, name)`` when ``by_kind``)."""

    def __init__(self, kinds: Sequence[str], records: Sequence[Record] = (), *,
                 by_kind: bool = False) -> None:
        super().__init__()
        self.kinds, self.by_kind = tuple(kinds), by_kind
        for record in records:
            self.register(record)

    def register(self, record: Record) -> Record:
        """Add ``record`` (replacing one with the same key); returns it (else a ``TypeError``:
        not a :class:`Record`, or one of a kind this registry does not hold)."""
        if not isinstance(record, Record) or record.kind not in self.kinds:
            raise TypeError(f"this registry takes {'/'.join(self.kinds)} records, "
                            f"got {record!r}")
        self[(record.kind, record.name) if self.by_kind else record.name] = record
        return record


@dataclasses.dataclass(frozen=True, eq=False)
class Configured:
    """An algorithm with its parameters (also attributes: ``ring(subchunks=2).subchunks``),
    callable as the contract says, formulas bound."""

    algorithm: Record
    run: AllReduce
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def __call__(self, values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        return self.run(values, op=op)

    def __copy__(self) -> Configured:
        return self  # frozen: a copy would be equal in every way

    def __deepcopy__(self, memo: dict[int, Any]) -> Configured:
        return self  # frozen record + read-only params (checkpoint restore deep-copies reducers)

    def __getattr__(self, key: str) -> Any:
        params = self.__dict__.get("params")
        if key.startswith("_") or params is None or key not in params:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")
        return params[key]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.algorithm.name}({args})"

    @property
    def name(self) -> str:
        """The record's name (also ``__name__``, for code that names callables by it)."""
        return self.algorithm.name

    __name__ = name  # type: ignore[assignment]

    def bytes_sent(self, n: int, nbytes: int, itemsize: int) -> list[float] | None:
        """Bytes each tower sends (None when the record has no formula for these params)."""
        formula = self.algorithm.bytes_sent
        out = None if formula is None else formula(n, nbytes, itemsize, **self.params)
        return None if out is None else list(out)

    def summation_depth(self, n: int) -> int | None:
        """The most additions on any element (None when the record has no formula)."""
        formula = self.algorithm.summation_depth
        return None if formula is None else int(formula(n, **self.params))


ALGORITHMS = Registry(["all_reduce"])
"""Registered algorithms: name -> :class:`Record`; ``ALGORITHMS[name]()`` builds the default."""

register = ALGORITHMS.register
"""Add an :class:`Algorithm` record to :data:`ALGORITHMS` (replacing one of the same name)."""


def record_of(fn: Any) -> Configured | None:
    """The :class:`Configured` behind ``fn`` (itself), or None for a plain callable."""
    return fn if isinstance(fn, Configured) else None


def algorithm_name(algorithm: Any) -> str:
    """A readable name (in errors, reports): ``name``, else ``__name__``, else the type's
    (a ``functools.partial``'s function's)."""
    while isinstance(algorithm, functools.partial):
        algorithm = algorithm.func
    for attribute in ("name", "__name__"):
        name = getattr(algorithm, attribute, None)
        if isinstance(name, str) and name:
            return name
    return type(algorithm).__name__


def register_schedule(name: str, generator: Callable[..., Schedule],
                      cost: Callable[..., Coefficients], doc: str | None, *,
                      own_first: bool = False) -> Record:
    """Register the all-reduce that runs ``generator(n, **params)``: its factory takes the
    parameters after ``n`` (ints >= 1, or a None default), its schedule is ``doc``'s drawing."""
    signature = inspect.signature(generator)
    signature = signature.replace(parameters=list(signature.parameters.values())[1:],
                                  return_annotation=AllReduce)

    def build(*args: Any, **kwargs: Any) -> AllReduce:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        params = {key: None if value is None and signature.parameters[key].default is None
                  else positive_int(key, value) for key, value in bound.arguments.items()}
        run = functools.partial(generator, **params) if params else generator
        return Scheduled(run, own_first)

    build.__signature__ = signature  # type: ignore[attr-defined]
    build.__name__ = build.__qualname__ = name
    return register(Algorithm(name, build, schedule=schedule_of(doc),
                              **from_schedule(generator, cost=cost)))
