"""Tools to prove a data-parallel setup right: Hypothesis strategies, error bounds, checkers.

    strategies.py  model families, optimizers and training cases for equivalence tests
    bounds/        every error bound: the sum and SGD-step bounds (on the one unit roundoff
                   and γ_k), the optimizers' tracked bounds, which bound holds an update,
                   the kernel-noise floor
    values.py      tower values (Hypothesis), ``assert_close`` and ULP distances
    properties.py  the properties of one all-reduce example (value, placement, bytes, replay)
    check.py       ``check_all_reduce``: an algorithm's properties over towers, shapes, dtypes, ops
    codec_check.py ``check_codec``: a codec's contract (error feedback, bytes, state, checkpoint)
    replay.py      a NumPy interpreter of an algorithm's traced graph (bitwise replay)
    kernels.py     the replay's NumPy kernel per op type (KERNELS), rounding as TF's CPU does
    onestep.py     one step from the same weights: per-example leaves, depths, the comparison
    invariance.py  ``check_invariance``: the same training on 1, 2, 4, 8 towers, step by step
    steps.py       the step protocol (``Step``) and ``as_step``, the adapter for a user's step
    report.py      ``BisectReport`` / ``Divergence``: what a comparison found
    causes.py      why a divergence may have happened: what its batches and sides show
    compare.py     ``compare``: two steps (or configurations), teacher-forced, every step
    bisect.py      ``bisect``: the first step, variable and element where two steps part
    matching.py    ``assert_steps_match`` and the ``step_cases`` strategy (plugin.py: fixture)

Users import from here to test their own models and algorithms::

    from hypothesis import given
    from towers.testing import training_cases, assert_weights_close, check_all_reduce
"""

from __future__ import annotations

from towers.testing.bisect import bisect
from towers.testing.bounds import gamma, sgd_step_bound, sum_bound, unit_roundoff
from towers.testing.check import CheckReport, check_all_reduce
from towers.testing.codec_check import CodecReport, check_codec
from towers.testing.compare import Config, compare
from towers.testing.invariance import InvarianceReport, check_invariance
from towers.testing.matching import assert_steps_match, step_batches, step_cases
from towers.testing.report import BisectReport, Divergence
from towers.testing.steps import Step, as_step
from towers.testing.strategies import (
    CENTRAL_STORAGE_FAMILIES,
    CENTRAL_STORAGE_OPTIMIZERS,
    FAMILIES,
    OPTIMIZERS,
    ModelSpec,
    TrainingCase,
    assert_weights_close,
    loss_fn,
    model_specs,
    no_empty_shards,
    per_tower_gradients,
    training_cases,
    weight_report,
)
from towers.testing.values import assert_close, tower_values, ulp_distance

__all__ = [
    "CENTRAL_STORAGE_FAMILIES",
    "CENTRAL_STORAGE_OPTIMIZERS",
    "FAMILIES",
    "OPTIMIZERS",
    "BisectReport",
    "CheckReport",
    "CodecReport",
    "Config",
    "Divergence",
    "InvarianceReport",
    "ModelSpec",
    "Step",
    "TrainingCase",
    "as_step",
    "assert_close",
    "assert_steps_match",
    "assert_weights_close",
    "bisect",
    "check_all_reduce",
    "check_codec",
    "check_invariance",
    "compare",
    "gamma",
    "loss_fn",
    "model_specs",
    "no_empty_shards",
    "per_tower_gradients",
    "sgd_step_bound",
    "step_batches",
    "step_cases",
    "sum_bound",
    "tower_values",
    "training_cases",
    "ulp_distance",
    "unit_roundoff",
    "weight_report",
]
