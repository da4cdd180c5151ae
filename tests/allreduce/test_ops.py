"""The reductions every registered algorithm offers: ``mean``'s rounding, ``product``,
integer dtypes, and the refusals that name what is missing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce import as_written

NAMES = sorted(towers.ALGORITHMS)


def _place(arrays: list[Any], dtype: tf.DType = tf.float32) -> list[tf.Tensor]:
    out = []
    for array, device in zip(arrays, DEVICES):
        with tf.device(device):
            out.append(tf.constant(array, dtype))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_mean_is_the_sum_divided_by_n(name: str) -> None:
    """Not the sum times a rounded 1/n (Grappler's rewrite): 0.1 three times, both ways."""
    tenth = np.float32(0.1)
    want = np.float32((tenth + tenth + tenth) / np.float32(3))
    assert want != np.float32((tenth + tenth + tenth) * np.float32(1 / 3))  # the test can fail
    algorithm = towers.ALGORITHMS[name]()
    for out in towers.all_reduce(_place([[0.1]] * 3), algorithm=name, op="mean"):
        assert out.numpy()[0] == want, out.numpy()[0]

    @tf.function(autograph=False)
    def mean(x: tf.Tensor) -> list[tf.Tensor]:
        values = []
        for device in DEVICES[:3]:
            with tf.device(device):
                values.append(tf.identity(x))
        return algorithm(values, op="mean")

    with as_written():  # how towers' trainers run their reductions
        outs = mean(tf.constant([0.1]))
    for out in outs:
        assert out.numpy()[0] == want, out.numpy()[0]


@pytest.mark.parametrize("name", NAMES)
def test_product_on_every_output(name: str) -> None:
    rng = np.random.default_rng(7)
    for n in (1, 2, 5, 8):
        # powers of two, zeros and signs: exact products in any order
        arrays = [rng.choice([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0], (3, 7)) for _ in range(n)]
        want = np.prod(np.array(arrays, np.float32), axis=0)
        for dtype in (tf.float32, tf.float64, tf.bfloat16):
            outs = towers.all_reduce(_place(arrays, dtype), algorithm=name, op="product")
            assert len(outs) == n
            for tower, out in enumerate(outs):
                assert out.device == _place([0.0] * n)[tower].device
                np.testing.assert_array_equal(out.numpy().astype(np.float32), want,
                                              err_msg=f"{name} tower {tower} of {n} {dtype}")
        ints = [rng.integers(-3, 4, (4,)) for _ in range(n)]
        for dtype in (tf.int32, tf.int64):
            for op, reduce in (("product", np.prod), ("sum", np.sum), ("max", np.max)):
                want_int = reduce(np.array(ints, np.int64), axis=0)
                for out in towers.all_reduce(_place(ints, dtype), algorithm=name, op=op):
                    assert out.dtype == dtype
                    np.testing.assert_array_equal(out.numpy(), want_int)


def test_refusals_name_what_is_missing() -> None:
    with pytest.raises(ValueError, match="op must be one of sum, mean, max, min, product"):
        towers.all_reduce(_place([[1.0]] * 2), algorithm="ring", op="prod")
    for dtype in (tf.int8, tf.uint8, tf.int16, tf.complex64):
        with pytest.raises(ValueError, match=f"dtype {dtype.name} is not supported; use one of"):
            towers.all_reduce(_place([[1]] * 2, dtype), algorithm="nccl", op="sum")
    with pytest.raises(ValueError, match="op='mean' is not defined for integer dtype int32"):
        towers.all_reduce(_place([[1]] * 2, tf.int32), algorithm="nccl_ring", op="mean")
