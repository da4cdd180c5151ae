"""One worker's input: tf.data's auto-shard policies, written out, and global batches cut.

Worker k of W (chief first: chief → 0, ``worker:i`` → i + #chief)::

    policy "file"  files  f0 f1 f2 f3 f4           worker 0: f0 f2 f4   (file i → i mod W)
                   W = 2                           worker 1: f1 f3
    policy "data"  elements e0 e1 e2 e3 e4         worker 0: e0 e2 e4   (element i → i mod W)
                   (BEFORE batching)               worker 1: e1 e3
    policy "auto"  "file" when the input is a list of at least W files, else "data"
    policy "off"   every worker reads everything: cut each global batch with
                   global_to_worker_batches (worker_slice) instead
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.cluster.spec import Cluster
from towers.guard.arguments import check_choice

__all__ = ["POLICIES", "global_to_worker_batches", "shard_dataset", "worker_of"]

POLICIES = ("auto", "file", "data", "off")  # tf.data.experimental.AutoShardPolicy's


def worker_of(cluster: Any) -> tuple[int, int]:
    """``(num_workers, worker_index)`` of a ``Cluster`` task or a ``(num_workers, index)`` pair."""
    if isinstance(cluster, Cluster):
        job, index = cluster.task_type, cluster.task_index
        if job not in ("chief", "worker") or index is None:
            raise ValueError(f"cluster must be a chief or worker task to read input, got "
                             f"task {job}:{index}")
        chiefs = len(cluster.jobs.get("chief", ()))
        return cluster.num_workers, index if job == "chief" else index + chiefs
    if (isinstance(cluster, tuple) and len(cluster) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in cluster)):
        workers, index = cluster
        if workers < 1 or not 0 <= index < workers:
            raise ValueError(f"cluster=(num_workers, index) needs num_workers >= 1 and "
                             f"0 <= index < num_workers, got {cluster}")
        return workers, index
    raise TypeError(f"cluster must be a towers.cluster.Cluster or a (num_workers, index) pair "
                    f"of ints, got {cluster!r}")


def _file_list(dataset: Any) -> tf.data.Dataset | None:
    if isinstance(dataset, (list, tuple)):
        if not dataset or not all(isinstance(f, str) for f in dataset):
            raise ValueError(f"dataset as a list must be a non-empty list of file names (str), "
                             f"got {list(dataset)[:3]!r}")
        return tf.data.Dataset.from_tensor_slices(list(dataset))
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"dataset must be a tf.data.Dataset or a list of file names, got "
                        f"{type(dataset).__name__}")
    spec = dataset.element_spec
    if isinstance(spec, tf.TensorSpec) and spec.dtype == tf.string and spec.shape.rank == 0:
        return dataset
    return None


def shard_dataset(dataset: Any, cluster: Any, *, policy: str = "auto",
                  read: Callable[[tf.data.Dataset], tf.data.Dataset] | None = None
                  ) -> tf.data.Dataset:
    """The input of one worker (``cluster``: a ``Cluster`` or ``(num_workers, index)``):
    ``dataset`` (unbatched elements, or a file list whose names ``read`` turns into records,
    e.g. ``tf.data.TFRecordDataset``) sharded by tf.data's auto-shard ``policy``.

    Example:
        >>> ds = tf.data.Dataset.range(5)
        >>> [int(v) for v in shard_dataset(ds, (2, 1), policy="data")]
        [1, 3]
    """
    check_choice("policy", policy, POLICIES)
    if read is not None and not callable(read):
        raise TypeError(f"read must be a callable (dataset of file names -> dataset of "
                        f"records), got {read!r}")
    workers, index = worker_of(cluster)
    files = _file_list(dataset)
    if files is None:
        if policy == "file":
            raise ValueError("policy='file' needs a file list as dataset: a list of file "
                             "names or a dataset of scalar strings (list_files)")
        return dataset if policy == "off" else dataset.shard(workers, index)
    count = int(files.cardinality())
    enough = count < 0 or count >= workers  # unknown cardinality: tf.data also tries files
    if policy == "file" and not enough:
        raise ValueError(f"policy='file' needs at least as many files as workers: {count} "
                         f"file(s) for {workers} workers; use policy='data' (or 'auto')")
    read = read or (lambda names: names)
    if policy == "off":
        return read(files)
    if policy == "file" or (policy == "auto" and enough):
        return read(files.shard(workers, index))
    return read(files).shard(workers, index)


def _cut(workers: int, index: int) -> Callable[..., Any]:

    def cut(*element: Any) -> Any:
        structure = element[0] if len(element) == 1 else element
        leaves = tf.nest.flatten(structure)
        size = tf.shape(leaves[0], out_type=tf.int64)[0]
        checks = [tf.debugging.assert_equal(
            tf.shape(t, out_type=tf.int64)[0], size,
            message="global_to_worker_batches: the tensors of a batch differ in batch size")
            for t in leaves[1:]]
        per = (size + workers - 1) // workers
        start = tf.minimum(index * per, size)
        stop = tf.minimum(start + per, size)
        with tf.control_dependencies(checks):
            return tf.nest.map_structure(lambda t: t[start:stop], structure)

    return cut


def global_to_worker_batches(dataset: tf.data.Dataset, cluster: Any) -> tf.data.Dataset:
    """Each global batch of ``dataset`` cut to this worker's ceil(B/W) rows (or fewer).

    Example:
        >>> ds = tf.data.Dataset.range(5).batch(5)
        >>> [v.numpy().tolist() for v in global_to_worker_batches(ds, (2, 1))]
        [[3, 4]]
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"dataset must be a tf.data.Dataset of global batches, got "
                        f"{type(dataset).__name__}")
    workers, index = worker_of(cluster)
    for spec in tf.nest.flatten(dataset.element_spec):
        if getattr(spec, "shape", None) is not None and spec.shape.rank == 0:
            raise ValueError("dataset must hold batches (every tensor with a batch dimension); "
                             "got a scalar element: batch the dataset first")
    return dataset.map(_cut(workers, index))

