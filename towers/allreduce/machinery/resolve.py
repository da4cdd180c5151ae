"""Resolve an all-reduce by name: :func:`get` (the registry's names, and ``noop``).

Its own module so that the wrappers (``bucketed``, ``compressed``, ``hierarchical``) and the
step's reducer resolve their inner algorithm without importing the package that imports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, check_values
from towers.allreduce.machinery.registry import ALGORITHMS
from towers.allreduce.machinery.specs import is_spec, user_algorithm


def noop(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """No exchange at all: every tower keeps its own value (a ceiling for benchmarks, not a sum)."""
    check_values(values, op)
    return list(values)


def get(algorithm: str | AllReduce) -> AllReduce:
    """Resolve a registry name or a user's ``module:NAME`` (or pass a callable through).

    Registered names are kept in :data:`ALGORITHMS`; ``noop`` is kept out on purpose
    (it does not reduce), but is accepted here for benchmarks. ``module:NAME`` (or
    ``file.py:NAME``) names an algorithm, a ``GradientReducer`` or a factory of either,
    as on the command line (:func:`~towers.allreduce.machinery.specs.user_algorithm`).

    Raises:
        ValueError: an unknown name (the message lists the registered names), a module
            that does not import.
        TypeError: neither a name nor a callable; a ``module:NAME`` that is neither.
    """
    if isinstance(algorithm, str):
        if is_spec(algorithm):
            return user_algorithm(algorithm)[1]
        if algorithm == "noop":
            return noop
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown all_reduce {algorithm!r}; registered: {', '.join(sorted(ALGORITHMS))} "
                "(or name your own as module:NAME)")
        return ALGORITHMS[algorithm]()
    if callable(algorithm):
        return algorithm
    raise TypeError(f"all_reduce must be a registered name or a callable, got {algorithm!r}")
