"""``all_to_all``: tower ``i``'s block ``j`` is tower ``j``'s block ``i``, bitwise, any count."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers.allreduce import all_to_all
from towers.allreduce.machinery.base import DTYPES


def _place(arrays: list[np.ndarray], dtype: tf.DType) -> list[tf.Tensor]:
    out = []
    for array, device in zip(arrays, DEVICES):
        with tf.device(device):
            out.append(tf.constant(array, dtype))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_all_to_all_matches_numpy(dtype: tf.DType) -> None:
    rng = np.random.default_rng(11)
    for n in range(1, 9):
        for rows in (1, 3):
            arrays = [rng.normal(size=(n * rows, 2, 3)) * 100 for _ in range(n)]
            values = _place(arrays, dtype)
            sent = [v.numpy() for v in values]  # in dtype: the bits each tower holds
            outs = all_to_all(values)
            assert len(outs) == n
            for i, out in enumerate(outs):
                want = np.concatenate([sent[j][i * rows:(i + 1) * rows] for j in range(n)])
                assert out.device == values[i].device and out.dtype == dtype
                assert out.numpy().tobytes() == want.tobytes(), f"{dtype.name} tower {i}/{n}"


def test_all_to_all_in_a_function() -> None:
    @tf.function(autograph=False)
    def run(x: tf.Tensor) -> list[tf.Tensor]:
        values = []
        for t, device in enumerate(DEVICES[:4]):
            with tf.device(device):
                values.append(x + 10.0 * t)
        return all_to_all(values)

    x = tf.range(4, dtype=tf.float32)
    outs = run(x)
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out.numpy(), [i + 10.0 * j for j in range(4)])


def test_all_to_all_refusals_name_the_argument() -> None:
    with pytest.raises(ValueError, match="not a multiple of the 3 towers"):
        all_to_all(_place([np.zeros(4)] * 3, tf.float32))
    with pytest.raises(ValueError, match=r"values\[0\] needs a static shape of rank >= 1"):
        all_to_all(_place([np.float32(1.0)] * 2, tf.float32))
    with pytest.raises(ValueError, match="dtype uint8 is not supported"):
        all_to_all(_place([np.zeros(2)] * 2, tf.uint8))
    with pytest.raises(TypeError, match="values must be a list"):
        all_to_all(_place([np.zeros(2)], tf.float32)[0])
