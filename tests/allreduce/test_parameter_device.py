"""Parameter device and naive: a left fold on one device in tower order, then copies out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from tests.allreduce.machinery.test_primitives import (
    Case,
    assert_base_checks,
    assert_matches_reference,
    cases,
    make_arrays,
    place,
)
from tests.allreduce.test_tree import FOLD, assert_bitwise
from tests.conftest import DEVICES
from towers.allreduce import naive, parameter_device
from towers.allreduce.machinery.primitives import record
from towers.devices import canonical_device


def left_fold(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """``((x0 ⊕ x1) ⊕ x2) ⊕ …`` in NumPy, rounding in the arrays' dtype; mean divides once."""
    out = arrays[0]
    for a in arrays[1:]:
        out = FOLD[op](out, a).astype(a.dtype)
    return (out / out.dtype.type(len(arrays))).astype(out.dtype) if op == "mean" else out


@given(cases(), st.integers(0, 7))
def test_the_parameter_device_folds_left_in_tower_order(case: Case, where: int) -> None:
    arrays = make_arrays(case)
    device = DEVICES[where]  # a tower's device or one beyond the towers
    with record() as rec:
        outs = parameter_device(device)(place(arrays), op=case.op)
    want = left_fold(arrays, case.op)
    for i, out in enumerate(outs):
        assert canonical_device(out.device) == DEVICES[i]
        assert_bitwise(out.numpy(), want, case.op)
    assert_matches_reference([outs[0].numpy()], arrays, case.op, case.n - 1)
    nbytes = int(np.prod(case.shape)) * case.dtype.size
    sent = rec.bytes_sent()  # every tower ships its value there; the device sends each back
    on = DEVICES.index(device)
    for i in range(case.n):
        want_bytes = (i != on) * nbytes + (i == on) * (case.n - (on < case.n)) * nbytes
        assert sent.get(DEVICES[i], 0) == want_bytes, i


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_naive_is_the_parameter_device_on_tower_0(op: str, n: int) -> None:
    """add_n (sums) and the fold (max, min) add in the same order: the same bits."""
    arrays = make_arrays(Case(n, (3, 7), tf.float32, op, n))
    ours = naive(place(arrays), op=op)[0].numpy()
    assert_bitwise(ours, parameter_device()(place(arrays), op=op)[0].numpy(), op)
    assert_bitwise(ours, left_fold(arrays, op), op)
    assert naive.bytes_sent(n, 40, 4) == parameter_device().bytes_sent(n, 40, 4)
    assert naive.summation_depth(n) == max(n - 1, 0)


@pytest.mark.parametrize("algorithm", [naive, parameter_device(), parameter_device(DEVICES[7])])
def test_base_checks(algorithm: Any) -> None:
    assert_base_checks(algorithm)
