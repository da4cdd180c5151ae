"""Tools to prove a data-parallel setup right: Hypothesis strategies, error bounds, checkers.

    values.py      tower values (Hypothesis), ``assert_close``, ULP distances, weight reports
    strategies.py  model families, optimizers, training cases and step batches
    bounds/        every error bound on the one unit roundoff; optimizers' tracked bounds;
                   the kernel-noise floor
    check.py       ``check_all_reduce``: an algorithm's properties (properties.py: one
                   example's) over towers, shapes, dtypes, ops
    codec_check.py ``check_codec``: a codec's contract
    replay.py      a NumPy interpreter of an algorithm's traced graph (kernels.py: its ops)
    steps.py       the step protocol (``Step``) and ``as_step``, the adapter for a user's step
    onestep.py     one step from the same weights: gradients, depths, the comparison
    report.py      what a comparison found (``BisectReport``, ``Divergence``)
    causes.py      why a divergence may have happened, read from its batches and sides
    compare.py     ``compare``, ``bisect``, ``assert_steps_match`` (plugin.py: the fixture)
    invariance.py  ``check_invariance``: the same training on 1, 2, 4, 8 towers

Example::

    from hypothesis import given
    from towers.testing import training_cases, assert_weights_close, check_all_reduce
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
