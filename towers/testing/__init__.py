"""Tools to prove a data-parallel setup right: Hypothesis strategies, error bounds, checkers.

    values, strategies   tower values, models, training cases, batches; assert_close, ULPs
    bounds/              every error bound on the one unit roundoff
    check, properties    check_all_reduce: an algorithm's properties over towers, shapes, dtypes
    codec_check          check_codec: a codec's contract
    replay, kernels      a NumPy interpreter of an algorithm's graph, bitwise
    steps                the step protocol (as_step); one step of two from the same weights
    compare, report      compare, bisect, assert_steps_match (plugin: the fixture); what they found
    causes               why a divergence may have happened
    invariance           check_invariance: the same training on 1, 2, 4, 8 towers
"""

from __future__ import annotations

from towers.testing.bounds import gamma, sgd_step_bound, sum_bound, unit_roundoff
from towers.testing.check import CheckReport, check_all_reduce
from towers.testing.codec_check import CodecReport, check_codec
from towers.testing.compare import Config, assert_steps_match, bisect, compare
from towers.testing.invariance import InvarianceReport, check_invariance
from towers.testing.report import BisectReport, Divergence
from towers.testing.steps import Step, as_step
from towers.testing.strategies import (
    CENTRAL_STORAGE_FAMILIES,
    CENTRAL_STORAGE_OPTIMIZERS,
    FAMILIES,
    OPTIMIZERS,
    ModelSpec,
    TrainingCase,
    loss_fn,
    model_specs,
    no_empty_shards,
    per_tower_gradients,
    step_batches,
    step_cases,
    training_cases,
)
from towers.testing.values import (
    assert_close,
    assert_weights_close,
    tower_values,
    ulp_distance,
    weight_report,
)

__all__ = ["CENTRAL_STORAGE_FAMILIES", "CENTRAL_STORAGE_OPTIMIZERS", "FAMILIES", "OPTIMIZERS",
           "BisectReport", "CheckReport", "CodecReport", "Config", "Divergence", "InvarianceReport",
           "ModelSpec", "Step", "TrainingCase", "as_step", "assert_close", "assert_steps_match",
           "assert_weights_close", "bisect", "check_all_reduce", "check_codec", "check_invariance",
           "compare", "gamma", "loss_fn", "model_specs", "no_empty_shards", "per_tower_gradients",
           "sgd_step_bound", "step_batches", "step_cases", "sum_bound", "tower_values",
           "training_cases", "ulp_distance", "unit_roundoff", "weight_report"]
