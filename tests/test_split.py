"""towers.split: MirroredStrategy's split rule, nested structures, unknown batch sizes."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import DEVICES
from towers.split import shard_sizes, split


def test_measured_examples() -> None:
    assert shard_sizes(10, 4) == [3, 3, 3, 1]
    assert shard_sizes(3, 4) == [1, 1, 1, 0]
    assert shard_sizes(9, 4) == [3, 3, 3, 0]


@given(batch=st.integers(0, 40), n=st.integers(1, 8))
def test_shards_cover_the_batch_in_order(batch: int, n: int) -> None:
    x = tf.reshape(tf.range(batch * 2), [batch, 2])
    shards = split(x, n)
    assert [int(s.shape[0]) for s in shards] == shard_sizes(batch, n)
    np.testing.assert_array_equal(tf.concat(shards, 0).numpy(), x.numpy())


@pytest.mark.parametrize("batch", [1, 3, 5, 7, 9, 10, 13])
def test_matches_mirrored_strategy(batch: int) -> None:
    n = 4
    strategy = tf.distribute.MirroredStrategy(DEVICES[:n])
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(tf.range(batch))
    )
    element = next(iter(dataset))
    theirs = [v.numpy().tolist() for v in strategy.experimental_local_results(element)]
    ours = [s.numpy().tolist() for s in split(tf.range(batch), n)]
    assert ours == theirs


def test_nested_structures_keep_their_shape() -> None:
    batch = {"a": tf.zeros([5, 3]), "b": (tf.ones([5]), tf.range(5))}
    shards = split(batch, 2)
    assert [int(s["a"].shape[0]) for s in shards] == [3, 2]
    np.testing.assert_array_equal(shards[1]["b"][1].numpy(), [3, 4])


def test_unknown_batch_size_inside_tf_function() -> None:
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def sizes(x: tf.Tensor) -> list[tf.Tensor]:
        return [tf.shape(s)[0] for s in split(x, 4)]

    assert [int(s) for s in sizes(tf.zeros([10, 2]))] == [3, 3, 3, 1]
    assert [int(s) for s in sizes(tf.zeros([3, 2]))] == [1, 1, 1, 0]


def test_leading_dimensions_must_agree() -> None:
    with pytest.raises(ValueError, match="share their leading"):
        split((tf.zeros([4, 2]), tf.zeros([5])), 2)


def test_scalars_and_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="scalar"):
        split(tf.constant(1.0), 2)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        split(tf.zeros([4]), 0)
