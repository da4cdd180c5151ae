"""shard_dataset and global_to_worker_batches: every element once, batches cut bitwise."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorflow.python.data.experimental.ops.distribute import batch_sizes_for_worker

from towers.cluster import Cluster
from towers.cluster.cross_worker import worker_slice
from towers.cluster.data import global_to_worker_batches, shard_dataset, worker_of
from towers.split import shard_sizes

from ..conftest import examples


def _values(dataset: tf.data.Dataset) -> list:
    """The scalar elements as Python values (ints, or bytes for strings)."""
    out = [v.numpy() for v in dataset]
    return [v if isinstance(v, bytes) else v.item() for v in out]


def _write_files(root: Path, sizes: list[int]) -> list[str]:
    """Text files whose lines are unique: file f holds ``f:0``, ``f:1``, ..."""
    names = []
    for f, n in enumerate(sizes):
        path = root / f"part-{f:03d}.txt"
        path.write_text("".join(f"{f}:{i}\n" for i in range(n)))
        names.append(str(path))
    return names


@settings(max_examples=examples(ci=12))
@given(workers=st.integers(1, 4), n=st.integers(0, 13))
def test_data_policy_gives_each_element_to_exactly_one_worker(workers: int, n: int) -> None:
    elements = list(range(100, 100 + n))
    shards = [_values(shard_dataset(tf.data.Dataset.from_tensor_slices(tf.constant(
        elements, tf.int64)), (workers, k), policy="data")) for k in range(workers)]
    for k, shard in enumerate(shards):
        assert shard == elements[k::workers]  # element i → worker i mod W, in order
    assert Counter(v for s in shards for v in s) == Counter(elements)


@pytest.mark.parametrize("workers,files", [(1, 1), (2, 2), (2, 5), (3, 4), (4, 7)])
def test_file_policy_gives_each_file_to_exactly_one_worker(tmp_path: Path, workers: int,
                                                           files: int) -> None:
    names = _write_files(tmp_path, [3 + f % 3 for f in range(files)])
    every = _values(tf.data.TextLineDataset(names))
    records = []
    for k in range(workers):
        mine = _values(shard_dataset(names, (workers, k), policy="file"))
        assert mine == [n.encode() for n in names[k::workers]]
        read = _values(shard_dataset(names, (workers, k), policy="file",
                                     read=tf.data.TextLineDataset))
        assert {r.split(b":")[0] for r in read} <= {str(f).encode()
                                                    for f in range(k, files, workers)}
        records += read
        auto = _values(shard_dataset(names, (workers, k), read=tf.data.TextLineDataset))
        assert auto == read  # "auto" with enough files is "file"
    assert Counter(records) == Counter(every)


def test_list_files_dataset_is_a_file_list(tmp_path: Path) -> None:
    names = _write_files(tmp_path, [2, 3, 4])
    listed = tf.data.Dataset.list_files(str(tmp_path / "*.txt"), shuffle=False)
    parts = [_values(shard_dataset(listed, (2, k), policy="file")) for k in (0, 1)]
    assert parts == [[names[0].encode(), names[2].encode()], [names[1].encode()]]


def test_auto_with_fewer_files_than_workers_shards_the_records(tmp_path: Path) -> None:
    names = _write_files(tmp_path, [4, 3])
    every = _values(tf.data.TextLineDataset(names))
    parts = [_values(shard_dataset(names, (3, k), read=tf.data.TextLineDataset))
             for k in range(3)]
    assert parts == [every[k::3] for k in range(3)]
    with pytest.raises(ValueError, match="policy='file' needs at least as many files"):
        shard_dataset(names, (3, 0), policy="file")


def test_off_gives_every_worker_everything(tmp_path: Path) -> None:
    names = _write_files(tmp_path, [2, 1])
    every = _values(tf.data.TextLineDataset(names))
    for k in range(3):
        assert _values(shard_dataset(names, (3, k), policy="off",
                                     read=tf.data.TextLineDataset)) == every
        assert _values(shard_dataset(tf.data.Dataset.range(5), (3, k), policy="off")) == [
            0, 1, 2, 3, 4]


def test_more_workers_than_elements_leaves_workers_empty() -> None:
    shards = [_values(shard_dataset(tf.data.Dataset.range(2), (4, k))) for k in range(4)]
    assert shards == [[0], [1], [], []]


def test_a_cluster_numbers_its_workers_chief_first() -> None:
    jobs = {"chief": ("h:1",), "worker": ("h:2", "h:3"), "ps": ("h:4",)}
    assert worker_of(Cluster(jobs, "chief", 0)) == (3, 0)
    assert worker_of(Cluster(jobs, "worker", 1)) == (3, 2)
    assert _values(shard_dataset(tf.data.Dataset.range(7), Cluster(jobs, "worker", 0))) == [1, 4]
    with pytest.raises(ValueError, match="cluster must be a chief or worker task"):
        worker_of(Cluster(jobs, "ps", 0))


@settings(max_examples=examples(ci=10))
@given(workers=st.integers(1, 4), sizes=st.lists(st.integers(0, 9), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_worker_batches_concatenate_to_the_global_batch_bitwise(workers: int, sizes: list[int],
                                                                seed: int) -> None:
    rng = np.random.default_rng(seed)
    batches = [(rng.normal(size=(b, 3)).astype("float32"), rng.integers(0, 9, size=(b,)))
               for b in sizes]
    spec = (tf.TensorSpec((None, 3), tf.float32), tf.TensorSpec((None,), tf.int64))
    dataset = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)
    parts = [list(global_to_worker_batches(dataset, (workers, k))) for k in range(workers)]
    for step, (x, y) in enumerate(batches):
        for k in range(workers):
            cut = worker_slice(len(x), workers, k)
            assert parts[k][step][0].shape[0] == cut.stop - cut.start  # empty workers: 0 rows
        for whole, i in ((x, 0), (y, 1)):
            joined = np.concatenate([parts[k][step][i].numpy() for k in range(workers)])
            assert joined.dtype == whole.dtype
            np.testing.assert_array_equal(joined.view(np.uint8), whole.view(np.uint8))


@pytest.mark.parametrize("batch,workers", [(8, 4), (6, 3), (5, 2), (5, 4), (7, 4), (1, 3)])
def test_mwms_rebatch_sizes_against_worker_slice(batch: int, workers: int) -> None:
    # worker 0's batch_sizes (one replica per worker) are every worker's share of a batch
    mwms = batch_sizes_for_worker(batch, workers, 1, 0).numpy().tolist()
    ours = shard_sizes(batch, workers)
    assert sum(mwms) == sum(ours) == batch
    assert mwms == [batch // workers + (i < batch % workers) for i in range(workers)]
    # ours puts ceil(B/W) on each worker in turn: the same as MWMS exactly when that is
    # balanced (MWMS's is the one balanced split with the larger parts first)
    assert (mwms == ours) == (max(ours) - min(ours) <= 1)


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    ds = tf.data.Dataset.range(4)
    with pytest.raises(ValueError, match="policy must be one of"):
        shard_dataset(ds, (2, 0), policy="FILE")
    with pytest.raises(TypeError, match="cluster must be"):
        shard_dataset(ds, "worker:0")
    with pytest.raises(TypeError, match="cluster must be"):
        shard_dataset(ds, (2, True))
    with pytest.raises(ValueError, match=r"cluster=\(num_workers, index\)"):
        shard_dataset(ds, (2, 2))
    with pytest.raises(ValueError, match=r"cluster=\(num_workers, index\)"):
        shard_dataset(ds, (0, 0))
    with pytest.raises(TypeError, match="dataset must be"):
        shard_dataset(np.arange(4), (2, 0))
    with pytest.raises(ValueError, match="dataset as a list must be a non-empty list"):
        shard_dataset([], (2, 0))
    with pytest.raises(ValueError, match="policy='file' needs a file list"):
        shard_dataset(ds, (2, 0), policy="file")
    with pytest.raises(TypeError, match="read must be a callable"):
        shard_dataset(["a"], (1, 0), read="TextLineDataset")
    with pytest.raises(TypeError, match=r"dataset must be a tf\.data\.Dataset of global batches"):
        global_to_worker_batches([np.zeros(3)], (2, 0))
    with pytest.raises(ValueError, match="dataset must hold batches"):
        global_to_worker_batches(ds, (2, 0))
    uneven = tf.data.Dataset.from_tensors((tf.zeros((3, 2)), tf.zeros((2,))))
    with pytest.raises(tf.errors.InvalidArgumentError, match="differ in batch size"):
        list(global_to_worker_batches(uneven, (2, 0)))
