"""towers.allreduce.machinery.rounding: the one unit roundoff and γ_k every bound builds on."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import towers
from towers.allreduce.machinery.rounding import UNIT_ROUNDOFF, gamma, unit_roundoff

PACKAGE = Path(towers.__file__).resolve().parent
HOME = PACKAGE / "allreduce" / "machinery" / "rounding.py"


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_the_unit_roundoff_is_half_the_gap_above_one(dtype: tf.DType) -> None:
    eps = float(ml_dtypes.finfo(dtype.as_numpy_dtype).eps)  # the gap above 1.0
    for spelling in (dtype, dtype.name, dtype.as_numpy_dtype):
        assert unit_roundoff(spelling) == eps / 2
    assert set(UNIT_ROUNDOFF) == {"float16", "bfloat16", "float32", "float64"}


def test_integers_are_exact() -> None:
    assert unit_roundoff(tf.int32) == 0.0 and gamma(7, np.int64) == 0.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gamma_is_highams_and_ends_where_the_bound_does(dtype: str) -> None:
    u = Fraction(unit_roundoff(dtype))
    for k in (0, 1, 5, 100):
        assert Fraction(gamma(k, dtype)) == pytest.approx(k * u / (1 - k * u), rel=2.0**-50)
    last = int(1 / u) - 1
    assert gamma(last, dtype) > 0 and gamma(last + 1, dtype) == float("inf")


def test_no_other_module_defines_a_unit_roundoff() -> None:
    """A bound elsewhere reads u from the one home; a second definition (a literal 2^-24, or
    one derived from eps) would let two bounds drift apart."""
    literal = re.compile(r"2(\.0)?\s*\*\*\s*-\s*(11|8|24|53)\b|finfo\([^)]*\)\.eps")
    found = [f"{path.relative_to(PACKAGE)}:{n}"
             for path in PACKAGE.rglob("*.py") if path != HOME
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if literal.search(line) and not line.lstrip().startswith((">>>", "..."))]  # fmt: skip
    assert not found, found
