"""Pre- and post-scaling (Horovod's ``prescale_factor``/``postscale_factor``): the values
are multiplied before the reduction and the results after, in the values' dtype."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES

NAMES = sorted(towers.ALGORITHMS)


def _place(arrays: list[Any], dtype: tf.DType) -> list[tf.Tensor]:
    out = []
    for array, device in zip(arrays, DEVICES):
        with tf.device(device):
            out.append(tf.constant(array, dtype))
    return out


def _by_hand(values: list[tf.Tensor], factor: float) -> list[tf.Tensor]:
    out = []
    for v in values:
        with tf.device(v.device):
            out.append(v * tf.constant(factor, v.dtype))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_scaling_is_bitwise_scaling_by_hand(name: str) -> None:
    rng = np.random.default_rng(3)
    for n in range(1, 9):
        arrays = [rng.normal(size=(5, 3)) for _ in range(n)]
        for dtype, pre, post in ((tf.float32, 0.3, 1.7), (tf.float16, 0.125, 3.0),
                                 (tf.float64, 1.0, 0.1)):
            values = _place(arrays, dtype)
            got = towers.all_reduce(values, algorithm=name, op="sum", prescale=pre,
                                    postscale=post)
            want = _by_hand(towers.all_reduce(_by_hand(values, pre), algorithm=name), post)
            assert len(got) == n
            for tower, (g, w) in enumerate(zip(got, want)):
                assert g.device == values[tower].device
                np.testing.assert_array_equal(g.numpy(), w.numpy(),
                                              err_msg=f"{name} {dtype.name} tower {tower}/{n}")
        ints = _place([rng.integers(-5, 6, (4,)) for _ in range(n)], tf.int32)
        got = towers.all_reduce(ints, algorithm=name, op="max", prescale=3, postscale=-2)
        want = _by_hand(towers.all_reduce(_by_hand(ints, 3), algorithm=name, op="max"), -2)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.numpy(), w.numpy())


@pytest.mark.parametrize("name", NAMES)
def test_prescale_keeps_an_fp16_sum_finite(name: str) -> None:
    values = _place([[60000.0]] * 8, tf.float16)
    plain = towers.all_reduce(values, algorithm=name)
    assert not np.isfinite(plain[0].numpy()).all()  # the test can fail
    for out in towers.all_reduce(values, algorithm=name, prescale=1 / 8):
        # 8 partial sums of 7500 (exact in fp16), each rounding by at most half an ulp
        assert np.isfinite(out.numpy()).all()
        np.testing.assert_allclose(out.numpy().astype(np.float64), [60000.0], rtol=8 * 2.0**-11)


def test_reduce_scatter_scales() -> None:
    rng = np.random.default_rng(5)
    for n in range(1, 9):
        values = _place([rng.normal(size=(7,)) for _ in range(n)], tf.float32)
        got = towers.allreduce.reduce_scatter(values, op="mean", prescale=0.5, postscale=3.0)
        want = _by_hand(towers.allreduce.reduce_scatter(_by_hand(values, 0.5), op="mean"), 3.0)
        for g, w in zip(got, want):
            assert g.device == w.device
            np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_bad_factors_are_refused_by_name() -> None:
    floats, ints = _place([[1.0]] * 2, tf.float32), _place([[1]] * 2, tf.int64)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="prescale must be finite"):
            towers.all_reduce(floats, algorithm="ring", prescale=bad)
        with pytest.raises(ValueError, match="postscale must be finite"):
            towers.allreduce.reduce_scatter(floats, postscale=bad)
    for bad in ("2", None, True, tf.constant(2.0)):
        with pytest.raises(TypeError, match="postscale must be a number"):
            towers.all_reduce(floats, algorithm="ring", postscale=bad)
    with pytest.raises(ValueError, match=r"prescale=0.5 is not an integer.*int64"):
        towers.all_reduce(ints, algorithm="ring", prescale=0.5)
    with pytest.raises(ValueError, match=r"postscale=0.5 is not an integer.*int64"):
        towers.allreduce.reduce_scatter(ints, postscale=0.5)
    out = towers.all_reduce(ints, algorithm="ring", prescale=2.0, postscale=np.int64(3))
    np.testing.assert_array_equal(out[0].numpy(), [12])
