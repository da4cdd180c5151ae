"""``WorkerTrainer`` in one process (one worker): what it extends, what it refuses.

With ``num_workers=1`` its count and guard all-reduces are skipped and ``AllTowers(1)``
is one in-process collective, so the paths every worker runs — an empty local batch
(tower 0 runs the model on 0 rows, the other towers are ``TowerTrainer``'s empty
towers), loss scaling, the guard, the replica check — run here without a cluster.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import towers
from tests.cluster.conftest import run_workers
from tests.conftest import DEVICES
from towers.allreduce.compressed import compressed
from towers.cluster.cross_worker import AllTowers, CrossWorker, WorkerTrainer
from towers.split import batch_tensors, shard_batch

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def regularized() -> keras.Model:
    """A classifier with an L2 kernel regularizer: an empty tower still owes gradients."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(5, activation="tanh", kernel_initializer=init(1),
                           kernel_regularizer=keras.regularizers.L2(0.1)),
        keras.layers.Dense(3, kernel_initializer=init(2))])


def _batch(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rows)
    return rng.random((rows, 6), dtype=np.float32), rng.integers(0, 3, rows).astype(np.int32)


def _worker(optimizer: Any, **kwargs: Any) -> WorkerTrainer:
    return WorkerTrainer(regularized, optimizer, LOSS, devices=DEVICES[:3], num_workers=1,
                         **kwargs)


@pytest.mark.long
def test_an_empty_worker_is_loss_scaled_like_its_other_towers() -> None:
    """A worker with 0 rows: tower 0 runs the model, towers 1 and 2 are empty towers that
    owe 1/3 of the regularization gradient each. The loss scale S is a power of two, so
    S·g / S is g exactly: loss-scaled and plain SGD end bitwise equal. (Towers 1 and 2
    without the scale contributed g/S: the weights differed by 2/3 of the L2 step.)"""
    plain, scaled = _worker(keras.optimizers.SGD(0.1)), _worker(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    start = plain.get_weights()
    for rows in (0, 5, 0):
        plain.train_step(*_batch(rows))
        scaled.train_step(*_batch(rows))
        for a, b in zip(plain.get_weights(), scaled.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    assert scaled.skipped_steps == plain.skipped_steps == 0
    assert not np.array_equal(start[0], plain.get_weights()[0])  # the L2 steps moved it
    assert int(scaled.optimizer.iterations) == 3


def test_the_model_runs_on_tower_0_of_an_empty_worker_only() -> None:
    trainer = _worker(keras.optimizers.SGD(0.1))
    shards = trainer.split(*_batch(0))
    assert trainer.model_towers(shards) == [0]
    assert trainer.model_towers(trainer.split(*_batch(2))) == [0, 1]


def test_a_nan_batch_is_skipped_and_raise_raises_after_changing_nothing() -> None:
    x, y = _batch(4)
    x[1, 0] = np.nan
    skip = _worker(keras.optimizers.SGD(0.1))
    before = skip.get_weights()
    skip.train_step(x, y)
    assert skip.skipped_steps == 1
    for a, b in zip(before, skip.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    strict = _worker(keras.optimizers.SGD(0.1), on_nonfinite="raise")
    with pytest.raises(towers.NonFiniteError, match="tower 0"):
        strict.train_step(x, y)
    for a, b in zip(before, strict.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    strict.train_step(*_batch(4))  # the next finite step runs and does not raise again
    assert strict.skipped_steps == 1


@pytest.mark.long
@pytest.mark.parametrize("kwargs", [
    {"check_replicas_every": 1}, {"step_timeout": 60.0},
    {"variables": "parameter_device"}, {"all_reduce": CrossWorker(1, op="sum")},
    {"all_reduce": "ring"},  # one worker: any local algorithm is the whole reduction
], ids=str)
def test_supported_options_train_like_the_default(kwargs: dict[str, Any]) -> None:
    """Each supported option against the default WorkerTrainer on 2 steps: the weights
    agree within float32 rounding of a 3-term sum per step (other summation orders)."""
    default = _worker(keras.optimizers.SGD(0.1))
    other = _worker(keras.optimizers.SGD(0.1), **kwargs)
    for rows in (7, 2):
        default.train_step(*_batch(rows))
        other.train_step(*_batch(rows))
    moved = False
    for a, b, c in zip(default.get_weights(), other.get_weights(), regularized().get_weights(),
                       strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # weights O(1), 2 steps × 2 ulp
        moved = moved or not np.array_equal(a, c)
    assert moved


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"variables": "sharded"}, r"trainer='WorkerTrainer' with variables='sharded' is refused.*"
                               r"variables='replicated'"),
    ({"num_workers": 2, "all_reduce": "ring"},
     r"WorkerTrainer\(num_workers=2\).*AllTowers\(2, op='sum'\).*all_reduce='ring'"),
    ({"num_workers": 2, "all_reduce": AllTowers(3, op="sum")},
     r"num_workers=2.*AllTowers\(num_workers=3"),
    ({"num_workers": 2, "all_reduce": compressed("ring", "fp16")},
     r"WorkerTrainer\(num_workers=2\).*compressed"),
    ({"all_reduce": CrossWorker(1, op="mean")}, "op='sum'"),
    ({"num_workers": 0}, "num_workers"), ({"timeout_seconds": 0}, "timeout_seconds"),
], ids=["sharded", "ring", "other-count", "compressed", "mean", "no-workers", "no-timeout"])
def test_unsupported_combinations_are_refused_naming_the_options(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        WorkerTrainer(regularized, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:2],
                      **{"num_workers": 1, **kwargs})


@pytest.mark.long
def test_workers_skip_and_raise_together_when_one_meets_a_nan() -> None:
    """2 workers × 2 towers (tests/cluster/train_worker.py), ``on_nonfinite="raise"``, a NaN
    in worker 0's part of step 1. The guard's decision is summed over the workers, so
    both raise ``NonFiniteError`` (worker 1's towers were finite: it names none), neither
    changes a bit, and both go on to step 2 together. Deciding alone, worker 1 would
    wait in the gradient collective for worker 0 until the timeout."""
    run = run_workers("--batches", "16,16,16", "--nan-at", "1", "--on-nonfinite", "raise",
                      "--timeout", "30")
    assert run.code == 0, run.out[-4000:]
    assert run.lines("NONFINITE") == {0: [["1", "0"]], 1: [["1", "-"]]}
    steps = run.lines("STEP")
    assert steps[0] == steps[1]  # same weights (digests) and skipped counts on both workers
    digests = [fields[2] for fields in steps[0]]
    assert digests[1] == digests[0] != digests[2]  # step 1 changed nothing, step 2 trained
    assert [fields[3] for fields in steps[0]] == ["0", "1", "1"]


def test_state_across_workers_is_refused_naming_the_variables_and_modes() -> None:
    def with_bn() -> keras.Model:
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(3),
                                 keras.layers.BatchNormalization()])

    with pytest.raises(ValueError, match=r"num_workers=2.*moving_mean.*"
                                         r"semantics='one_device'.*TowerTrainer"):
        WorkerTrainer(with_bn, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:2],
                      num_workers=2)
    with pytest.raises(ValueError, match=r"trainer='WorkerTrainer'.*semantics='mirrored' is "
                                         r"refused.*semantics='one_device'"):
        WorkerTrainer(with_bn, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:2],
                      num_workers=2, semantics="mirrored")
    one = WorkerTrainer(with_bn, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:2],
                        num_workers=1)  # one worker: its towers are all the copies
    one.train_step(*_batch(4))
    assert len({w[-1].tobytes() for w in one.replica_weights()}) == 1


def test_sparse_gradients_across_workers_are_refused_when_traced() -> None:
    """Construction cannot see that a gradient will be sparse; the first trace of the
    reduce phase refuses it before any cross-worker collective runs."""
    def embedding() -> keras.Model:
        return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(5, 3),
                                 keras.layers.Flatten(), keras.layers.Dense(3)])

    trainer = WorkerTrainer(embedding, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:2],
                            num_workers=2)
    x, y = np.array([[0, 1], [1, 1], [4, 2]], np.int32), np.array([0, 2, 1], np.int32)
    # a local split: no count all-reduce
    shards = shard_batch(*batch_tensors(x, y, None, trainer.model), 2)
    with pytest.raises(ValueError, match=r"num_workers=2\) with sparse gradients .*embeddings"
                                         r".*sparse='gather'.*TowerTrainer"):
        trainer.reduce(trainer.forward_backward(shards))
