"""towers.split.distribute: the per-device input pipeline.

Each tower's shard is exactly :func:`towers.split.split`'s (MirroredStrategy's rule,
empty shards included) and lands on its tower's device; a step fed by the pipeline
(``TowerTrainer.train_step_shards``) is bitwise the step that slices on the host.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers.devices import canonical_device
from towers.split import Shards, distribute, shard_sizes, split
from towers.step import TowerTrainer

SIZES = range(1, 18)  # every global batch size 1..17: uneven and empty shards for n up to 8


def _batches_of_every_size() -> tf.data.Dataset:
    """One global batch of each size in SIZES, distinct values everywhere."""
    def batch(b: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        start = b * (b - 1) // 2
        rows = tf.range(start, start + b)
        x = tf.reshape(tf.cast(tf.range(2 * start, 2 * (start + b)), tf.float32), [-1, 2])
        return x, rows, tf.cast(rows, tf.float32) / 7.0

    return tf.data.Dataset.range(SIZES[0], SIZES[-1] + 1).map(batch)


# every tower count for the default pipeline; per_device builds n iterators: a few counts
RULE_CASES = [("multi_device", n) for n in range(1, 9)] + [("per_device", n) for n in (1, 3, 8)]


@pytest.mark.parametrize("pipeline,n", RULE_CASES, ids=[f"{p}-{n}" for p, n in RULE_CASES])
def test_shards_are_the_host_split_on_their_devices(pipeline: str, n: int) -> None:
    devices = DEVICES[:n]
    host = list(_batches_of_every_size())
    got = list(distribute(_batches_of_every_size(), devices, pipeline=pipeline))
    assert len(got) == len(host)
    for (x, y, w), shards in zip(host, got):
        b = int(x.shape[0])
        assert int(shards.global_batch) == b
        assert shards.sizes == shard_sizes(b, n)
        expected = split((x, y, w), n)
        for tower, (part, want) in enumerate(zip(shards.parts, expected)):
            for got_t, want_t in zip(part, want):
                assert canonical_device(got_t.device) == canonical_device(devices[tower])
                assert got_t.dtype == want_t.dtype and got_t.shape == want_t.shape
                np.testing.assert_array_equal(got_t.numpy(), want_t.numpy())


def test_nested_inputs_keep_their_structure_and_weights_default_to_none() -> None:
    x = {"a": tf.reshape(tf.range(10.0), [5, 2]), "b": tf.range(5)}
    data = tf.data.Dataset.from_tensors((x, tf.range(5) * 10))
    [shards] = list(distribute(data, DEVICES[:2], prefetch=1))
    (x0, y0, w0), (x1, y1, w1) = shards.parts
    np.testing.assert_array_equal(y1.numpy(), [30, 40])
    assert w0 is None and w1 is None and sorted(x0) == ["a", "b"]
    np.testing.assert_array_equal(x1["a"].numpy(), [[6.0, 7.0], [8.0, 9.0]])
    np.testing.assert_array_equal(y0.numpy(), [0, 10, 20])
    assert canonical_device(x1["b"].device) == canonical_device(DEVICES[1])


def _model() -> keras.Model:
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                             keras.layers.Dense(3)])  # fmt: skip


def _trainer(n: int, variables: str = "replicated", optimizer: str = "sgd") -> TowerTrainer:
    keras.utils.set_random_seed(3)
    make = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(0.01)}[optimizer]  # fmt: skip
    return TowerTrainer(_model, make, "sparse_categorical_crossentropy", devices=DEVICES[:n],
                        variables=variables)  # fmt: skip


@pytest.mark.long
def test_training_from_the_pipeline_is_bitwise_host_slicing() -> None:
    # 16 examples in batches of 7 over 3 towers: shards [3, 3, 1] and, for the last
    # batch of 2, [1, 1, 0] (an empty tower); float64 sample weights, cast by the step.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5)).astype(np.float32)
    y = rng.integers(0, 3, 16).astype(np.int32)
    w = rng.random(16)
    data = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(7)
    host, fed = _trainer(3, optimizer="adam"), _trainer(3, optimizer="adam")
    host_losses = [host.train_step(*b).numpy() for b in data.as_numpy_iterator()]
    fed_losses = [fed.train_step_shards(s).numpy() for s in distribute(data, fed.devices)]
    np.testing.assert_array_equal(fed_losses, host_losses)
    for a, b in zip(fed.get_weights(), host.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(fed.optimizer.variables, host.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.long  # 11 s
def test_outputs_are_the_host_steps_and_two_epochs_are_two_passes() -> None:
    """per_device with parameter_device variables: outputs and losses of two epochs."""
    x = np.arange(30, dtype=np.float32).reshape(6, 5) / 30
    y = np.array([0, 1, 2, 0, 1, 2], dtype=np.int32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)  # batches of 5 and 1
    host, fed = _trainer(2, "parameter_device"), _trainer(2, "parameter_device")
    pipeline = distribute(data, fed.devices, pipeline="per_device")
    for _ in range(2):  # each iter() is one epoch
        for (xb, yb), shards in zip(data, pipeline, strict=True):
            loss_h, out_h = host.train_step(xb, yb, return_outputs=True)
            loss_f, out_f = fed.train_step_shards(shards, return_outputs=True)
            assert loss_f.numpy() == loss_h.numpy()
            np.testing.assert_array_equal(out_f.numpy(), out_h.numpy())


# -- bad inputs ---------------------------------------------------------------------------------

XY = (np.zeros((4, 5), np.float32), np.zeros(4, np.int32))
BAD_DATASETS = {
    "not-a-dataset": (XY, TypeError, "dataset must be a tf.data.Dataset"),
    "unbatched": (tf.data.Dataset.from_tensor_slices(XY), ValueError, "dataset looks unbatched"),
    "leading-dims-differ": (tf.data.Dataset.from_tensors((tf.zeros([4, 5]), tf.zeros([3]))),
                            ValueError, "dataset looks unbatched"),
    "x-alone": (tf.data.Dataset.from_tensors(tf.zeros([4, 5])), TypeError,
                r"dataset's elements must be tuples \(x, y\)"),
    "four-parts": (tf.data.Dataset.from_tensors((tf.zeros([4]),) * 4), TypeError,
                   r"dataset's elements must be tuples"),
    "ragged": (tf.data.Dataset.from_tensors((tf.ragged.constant([[1], [2, 3]]), tf.zeros([2]))),
               TypeError, "dataset's elements must hold dense tensors"),
}


@pytest.mark.parametrize("name", BAD_DATASETS)
def test_bad_datasets_are_refused_naming_the_argument(name: str) -> None:
    dataset, error, message = BAD_DATASETS[name]
    with pytest.raises(error, match=message):
        distribute(dataset, DEVICES[:2])


def test_bad_devices_and_options_are_refused() -> None:
    data = tf.data.Dataset.from_tensors(XY)
    with pytest.raises(ValueError, match="devices is empty"):
        distribute(data, [])
    with pytest.raises(TypeError, match="devices must be a list"):
        distribute(data, "/cpu:0")
    with pytest.raises(ValueError, match="pipeline must be one of"):
        distribute(data, DEVICES[:2], pipeline="host")
    with pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        distribute(data, DEVICES[:2], prefetch=0)


def test_bad_shards_are_refused_before_the_step() -> None:
    trainer = _trainer(2)
    x, y = tf.zeros([3, 5]), tf.zeros([3], tf.int32)
    with pytest.raises(TypeError, match=r"shards must be a towers\.split\.Shards"):
        trainer.train_step_shards((x, y))  # type: ignore[arg-type]
    three = trainer.split(x, y)._replace(parts=(trainer.split(x, y).parts * 2)[:3])
    with pytest.raises(ValueError, match="shards must hold 2 parts"):
        trainer.train_step_shards(three)
    uneven = Shards(((x[:1], y[:1], None), (x[1:], y[1:], None)), tf.constant(3))
    with pytest.raises(ValueError, match=r"sizes \[1, 2\] are not MirroredStrategy's split"):
        trainer.train_step_shards(uneven)
    no_y = Shards(((x[:2], None, None), (x[2:], None, None)), tf.constant(3))
    with pytest.raises(ValueError, match="y is None"):
        trainer.train_step_shards(no_y)
    assert trainer.trace_count == 0  # nothing was traced, nothing changed


def test_a_trainer_that_cuts_its_own_batches_refuses_shards() -> None:
    class OwnSplit(TowerTrainer):
        batch_is_global = False  # a trainer that cuts its batches itself declares it

        def split(self, x, y, sample_weight=None):  # type: ignore[no-untyped-def]
            return super().split(x, y, sample_weight)

    keras.utils.set_random_seed(3)
    trainer = OwnSplit(_model, keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
                       devices=DEVICES[:2])  # fmt: skip
    x, y = tf.zeros([3, 5]), tf.zeros([3], tf.int32)
    with pytest.raises(TypeError, match=r"OwnSplit cuts its batches itself \(OwnSplit.split\)"):
        trainer.train_step_shards(trainer.split(x, y))
