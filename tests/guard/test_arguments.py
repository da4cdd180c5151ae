"""The one module of argument checks: each names the argument and what it expected."""

from __future__ import annotations

import numpy as np
import pytest

from towers.guard.arguments import (
    check_choice,
    non_negative_float,
    non_negative_int,
    optional,
    positive_float,
    positive_int,
)


def test_counts_accept_integers_and_return_ints() -> None:
    assert positive_int("n", 3) == 3
    assert type(positive_int("n", np.int64(3))) is int
    assert non_negative_int("seed", 0) == 0


@pytest.mark.parametrize("value", [0, -1, 2.0, "2", True, None])
def test_positive_int_refuses_what_is_no_count(value: object) -> None:
    with pytest.raises(ValueError, match=f"chunks must be an int >= 1, got {value!r}"):
        positive_int("chunks", value)


def test_non_negative_int_refuses_negatives() -> None:
    with pytest.raises(ValueError, match="length must be an int >= 0, got -1"):
        non_negative_int("length", -1)


def test_floats() -> None:
    assert positive_float("timeout", 2) == 2.0
    assert non_negative_float("nbytes", 0) == 0.0
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="timeout must be positive"):
            positive_float("timeout", bad)
    for bad in (-1, float("inf"), float("nan"), False):
        with pytest.raises(ValueError, match="nbytes must be a finite number >= 0"):
            non_negative_float("nbytes", bad)


def test_check_choice_lists_the_choices() -> None:
    assert check_choice("op", "sum", ("sum", "mean")) == "sum"
    for bad in ("prod", None, ["sum"]):
        with pytest.raises(ValueError, match="op must be one of sum, mean, got"):
            check_choice("op", bad, ("sum", "mean"))


def test_optional_lets_none_through_and_says_so_when_refusing() -> None:
    assert optional(positive_int, "keep", None) is None
    assert optional(positive_int, "keep", 2) == 2
    with pytest.raises(ValueError, match="keep must be None or an int >= 1, got 0"):
        optional(positive_int, "keep", 0)
