"""The registry: one frozen record per all-reduce algorithm, and the configured algorithm.

An :class:`Algorithm` record holds everything tools need to know about an
algorithm: its name, the factory that builds it, the bytes each tower sends, the
summation depth (for the error bound), the α-β-γ cost, the schedule drawn in its
module docstring, and two flags (``estimated``: the bytes are an estimate, the
data moves inside opaque collectives; ``replayable``: its traced graph can be
replayed in NumPy). Every formula takes the factory's parameters as keywords.

Calling a record builds the algorithm: ``ALGORITHMS["ring"](subchunks=2)`` (and
``ring(subchunks=2)``, the same record) returns a :class:`Configured`, a frozen
callable that knows its record and its parameters, so its formulas need no
attributes pinned on a function::

    >>> algo = ring(subchunks=2)                  # doctest: +SKIP
    >>> algo.params, algo.bytes_sent(4, 64, 4)    # doctest: +SKIP
    ({'subchunks': 2}, [96, 96, 96, 96])

Adding an algorithm is one module and one line at its end::

    RING = register(Algorithm("ring", _build, bytes_sent=..., summation_depth=..., cost=...))

A user's algorithm registers the same way; a plain callable without a record is
still accepted everywhere (tools then say which properties they could not check).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import tensorflow as tf

from towers.allreduce.base import AllReduce

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Coefficients",
    "Configured",
    "algorithm_name",
    "record_of",
    "register",
    "schedule_of",
]

Coefficients = tuple[float, float, float]
"""``(a, b, c)``: a time of ``a·α + b·β + c·γ`` (see :mod:`towers.bench.costmodel`)."""


def schedule_of(doc: str | None) -> str:
    """The drawn schedule of a module docstring: its first ``::`` block, dedented."""
    lines = (doc or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.rstrip().endswith("::")), None)
    if start is None:
        return ""
    block: list[str] = []
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip("\n")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """What an all-reduce algorithm is: its name, factory, formulas, schedule and flags.

    Attributes:
        name: the registry name.
        factory: builds the algorithm; its keyword parameters are the formulas' ``params``.
        bytes_sent: ``(n, nbytes, itemsize, **params) -> per-tower bytes`` (None:
            unknown for these params), exact for algorithms that send with ``send``.
        summation_depth: ``(n, **params) -> int``, the most additions any element
            goes through (the error bound's ``k``).
        cost: ``(n, nbytes, **params) -> (a, b, c)``, the α-β-γ coefficients; its
            parameters are the cost model's (they may differ from the factory's).
        schedule: the ASCII schedule from the module docstring.
        estimated: ``bytes_sent`` is an estimate (opaque collectives move the data).
        replayable: the NumPy replay can follow its traced graph.
    """

    name: str
    factory: Callable[..., AllReduce]
    bytes_sent: Callable[..., Sequence[float] | None] | None = None
    summation_depth: Callable[..., int] | None = None
    cost: Callable[..., Coefficients] | None = None
    schedule: str = ""
    estimated: bool = False
    replayable: bool = True

    def __call__(self, *args: Any, **kwargs: Any) -> Configured:
        """Build the algorithm (``ALGORITHMS[name]()`` gives the defaults)."""
        built = self.factory(*args, **kwargs)
        if isinstance(built, Configured) and built.algorithm is self:
            return built
        return Configured(self, built, _bound(self.factory, args, kwargs))


def _bound(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        bound = inspect.signature(factory).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return dict(kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


@dataclasses.dataclass(frozen=True, eq=False)
class Configured:
    """An algorithm with its parameters: callable as the contract says, formulas bound.

    ``params`` are also readable as attributes (``ring(subchunks=2).subchunks``).
    """

    algorithm: Algorithm
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
        """The record's name."""
        return self.algorithm.name

    @property
    def __name__(self) -> str:  # for code that names callables by ``__name__``
        return self.algorithm.name

    def bytes_sent(self, n: int, nbytes: int, itemsize: int) -> list[float] | None:
        """Bytes each tower sends (None when the record has no formula for these params)."""
        formula = self.algorithm.bytes_sent
        out = None if formula is None else formula(n, nbytes, itemsize, **self.params)
        return None if out is None else list(out)

    def summation_depth(self, n: int) -> int | None:
        """The most additions on any element (None when the record has no formula)."""
        formula = self.algorithm.summation_depth
        return None if formula is None else int(formula(n, **self.params))


ALGORITHMS: dict[str, Algorithm] = {}
"""Registered algorithms: name -> :class:`Algorithm`; ``ALGORITHMS[name]()`` builds the default."""


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to :data:`ALGORITHMS` (replacing one of the same name); returns it.

    Example:
        >>> register(Algorithm("mine", lambda: my_all_reduce, summation_depth=lambda n: n - 1))
        ... # doctest: +SKIP
    """
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"register takes an Algorithm record, got {algorithm!r}")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def record_of(fn: Any) -> Configured | None:
    """The :class:`Configured` behind ``fn`` (itself), or None for a plain callable."""
    return fn if isinstance(fn, Configured) else None


def algorithm_name(fn: Any) -> str:
    """A readable name: the record's, else the callable's ``__name__``, else its repr."""
    if isinstance(fn, Configured):
        return fn.name
    return str(getattr(fn, "__name__", repr(fn)))
