"""Tools to prove a data-parallel setup right: strategies, bounds, checkers (docs/testing.md)."""

from __future__ import annotations

from towers.testing.bounds import gamma, sgd_step_bound, sum_bound, unit_roundoff
from towers.testing.check import CheckReport, check_all_reduce
from towers.testing.codec_check import CodecReport, check_codec
from towers.testing.compare import Config, assert_steps_match, bisect, compare
from towers.testing.invariance import InvarianceReport, check_invariance
from towers.testing.report import BisectReport, Divergence
from towers.testing.steps import Step, as_step
from towers.testing.strategies import (
    FAMILIES,
    ModelSpec,
    loss_fn,
    per_tower_gradients,
    step_batches,
    step_cases,
)
from towers.testing.values import (
    assert_close,
    assert_weights_close,
    tower_values,
    ulp_distance,
    weight_report,
)

__all__ = ["FAMILIES", "BisectReport", "CheckReport", "CodecReport", "Config", "Divergence",
           "InvarianceReport", "ModelSpec", "Step", "as_step", "assert_close", "assert_steps_match",
           "assert_weights_close", "bisect", "check_all_reduce", "check_codec", "check_invariance",
           "compare", "gamma", "loss_fn", "per_tower_gradients", "sgd_step_bound", "step_batches",
           "step_cases", "sum_bound", "tower_values", "ulp_distance", "unit_roundoff",
           "weight_report"]
