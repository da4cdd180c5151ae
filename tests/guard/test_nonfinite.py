"""The guard's fused check: a finite sum proves every element finite; on an overflowed
sum the elementwise pass decides, so finite values whose sum overflows are not flagged."""

import numpy as np
import pytest
import tensorflow as tf

from towers.guard.nonfinite import _all_finite, tower_code

BIG = np.float32(3e38)  # two of them overflow float32's sum


@pytest.mark.parametrize(
    "values, finite",
    [
        pytest.param([[1.0, 2.0], [3.0]], True, id="finite"),
        pytest.param([[BIG, BIG], [BIG]], True, id="sum-overflows-elements-finite"),
        pytest.param([[BIG], [-BIG, BIG, BIG]], True, id="partial-sums-overflow"),
        pytest.param([[1.0, np.inf], [2.0]], False, id="inf"),
        pytest.param([[np.inf], [-np.inf]], False, id="inf-minus-inf-across-values"),
        pytest.param([[1.0], [np.nan, 1.0]], False, id="nan"),
        pytest.param([[BIG, BIG], [np.nan]], False, id="overflow-and-nan"),
        pytest.param([[-BIG, -BIG, np.inf]], False, id="inf-after-negative-overflow"),
        pytest.param([], True, id="no-values"),
    ],
)
def test_all_finite_is_exact(values, finite):
    tensors = [tf.constant(v, tf.float32) for v in values]
    assert bool(_all_finite(tensors)) is finite
    assert bool(tf.function(_all_finite)(tensors)) is finite


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"], ids=str)
def test_all_finite_other_dtypes(dtype):
    big = tf.constant([6e4, 6e4] if dtype == "float16" else [1e38, 3e38], dtype)
    assert bool(_all_finite([big, big]))  # the sum overflows (float16, and float32's total)
    assert not bool(_all_finite([big, tf.constant([np.nan], dtype)]))


def test_tower_code_bits_and_sparse_values():
    nan_slices = tf.IndexedSlices(tf.constant([[np.nan]]), tf.constant([0]), tf.constant([2, 1]))
    code = tower_code(tf.constant(np.inf), [tf.constant([BIG, BIG]), nan_slices],
                      [tf.constant([1.0]), tf.constant([7], tf.int64)])
    assert int(code) == 1 + 2
    assert int(tower_code(tf.constant(1.0), [tf.constant([BIG, BIG])],
                          [tf.constant([-np.inf])])) == 4
