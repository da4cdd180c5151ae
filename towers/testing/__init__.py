"""Tools to prove a data-parallel setup right: Hypothesis strategies, one error bound, checkers.

    strategies.py  model families, optimizers and training cases for equivalence tests
    check.py       ``check_all_reduce``: an algorithm's properties over towers, shapes, dtypes, ops
    replay.py      a NumPy interpreter of an algorithm's traced graph (bitwise replay)

Users import from here to test their own models and algorithms::

    from hypothesis import given
    from towers.testing import training_cases, assert_weights_close, check_all_reduce
"""

from __future__ import annotations

from towers.testing.check import CheckReport, assert_close, check_all_reduce, tower_values
from towers.testing.strategies import (
    FAMILIES,
    OPTIMIZERS,
    ModelSpec,
    TrainingCase,
    assert_weights_close,
    gamma,
    loss_fn,
    model_specs,
    no_empty_shards,
    per_tower_gradients,
    sgd_step_bound,
    training_cases,
    ulp_distance,
    weight_report,
)

__all__ = [
    "FAMILIES",
    "OPTIMIZERS",
    "CheckReport",
    "ModelSpec",
    "TrainingCase",
    "assert_close",
    "assert_weights_close",
    "check_all_reduce",
    "gamma",
    "loss_fn",
    "model_specs",
    "no_empty_shards",
    "per_tower_gradients",
    "sgd_step_bound",
    "tower_values",
    "training_cases",
    "ulp_distance",
    "weight_report",
]
