"""variables="sharded" (ZeRO 1–2): bitwise equal to replicated over the ring, shard state, errors.

The reference is ``variables="replicated"`` with ``all_reduce="ring"``: sharded runs the
ring's own reduce-scatter phase on the same chunks, so every sum is added in the same
order, and the optimizers below are elementwise, so a shard's update is the full
variable's update restricted to it. Equality is therefore exact (``assert_array_equal``),
for the loss, every replica's weights and every optimizer slot.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES, examples
from tests.strategies import OPTIMIZERS
from towers.allreduce.machinery.sharding import VariableShards
from towers.allreduce.ring import ring
from towers.guard.errors import CheckpointError
from towers.placement import optimizer_state_bytes
from towers.testing import ModelSpec, loss_fn
from towers.training import checkpoint
from towers.training.models import mlp

SHARDABLE = {
    **OPTIMIZERS,
    "adamw_clipvalue": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, clipvalue=0.05),
}
"""Elementwise optimizers; decoupled weight decay and value clipping are per element too."""


def _excluding_bias() -> keras.optimizers.Optimizer:
    optimizer = keras.optimizers.AdamW(weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def _trainer(
    spec: ModelSpec, n: int, optimizer: str = "adam", variables: str = "sharded", **kwargs: Any
) -> towers.TowerTrainer:
    return towers.TowerTrainer(spec.build, SHARDABLE[optimizer], loss_fn(), devices=DEVICES[:n],
                               all_reduce="ring", variables=variables, **kwargs)  # fmt: skip


def _pair(
    spec: ModelSpec, n: int, optimizer: str = "adam", **kwargs: Any
) -> tuple[towers.TowerTrainer, towers.TowerTrainer]:
    """(replicated over the ring, sharded) trainers of the same model and optimizer."""
    reference = _trainer(spec, n, optimizer, "replicated", **kwargs)
    return reference, _trainer(spec, n, optimizer, **kwargs)


def _slots(trainer: towers.TowerTrainer) -> dict[tuple[int, str], np.ndarray]:
    """``{(variable index, slot kind): flat values}``; a sharded trainer's shards concatenated.

    Keras names a slot ``<variable name>_<kind>``; shard ``j`` of owner ``k`` is named
    ``shard_<k>_<j>``, so the owners' pieces are put back together in owner order.
    """
    if trainer.placement.name != "sharded":
        names = [v.path.replace("/", "_") + "_" for v in trainer.model.trainable_variables]
        out = {}
        for s in trainer.optimizer.variables:
            for j, prefix in enumerate(names):
                if s.name.startswith(prefix):
                    out[(j, s.name[len(prefix):])] = np.ravel(s.numpy())
        return out
    pieces: dict[tuple[int, str], list[np.ndarray]] = {}
    for replica in trainer.replicas:  # owner order
        for s in replica.optimizer.variables:
            found = re.fullmatch(r"shard_\d+_(\d+)_(\w+)", s.name)
            if found:
                key = (int(found[1]), found[2])
                pieces.setdefault(key, []).append(np.ravel(s.numpy()))
    return {k: np.concatenate(v) for k, v in pieces.items()}


def _assert_same(reference: towers.TowerTrainer, sharded: towers.TowerTrainer) -> None:
    """Every replica's weights, every optimizer slot and the step counts: bitwise."""
    expected = reference.get_weights()
    for replica in sharded.replica_weights():
        for a, b in zip(expected, replica):
            np.testing.assert_array_equal(a, b)
    slots, shard_slots = _slots(reference), _slots(sharded)
    assert slots.keys() == shard_slots.keys()  # none for plain SGD
    for key, value in slots.items():
        np.testing.assert_array_equal(value, shard_slots[key], err_msg=str(key))
    steps = {int(r.optimizer.iterations) for r in sharded.replicas}
    assert steps == {int(reference.optimizer.iterations)}


@pytest.mark.long
@settings(max_examples=examples(ci=4), deadline=None)
@given(
    family=st.sampled_from(["dense", "regularized", "batchnorm", "dropout"]),
    optimizer=st.sampled_from(sorted(SHARDABLE)),
    n=st.integers(1, 8),
    size=st.integers(1, 12),
)
def test_sharded_equals_replicated_ring_bitwise(
    family: str, optimizer: str, n: int, size: int
) -> None:
    # a batch smaller than n leaves towers empty; BatchNorm keeps the mean of the towers'
    # updates; one batch size (one trace per trainer), two steps (slots already non-zero)
    spec = ModelSpec(family)
    reference, sharded = _pair(spec, n, optimizer)
    for k in range(2):
        batch = spec.batch(size, seed=k)
        assert float(reference.train_step(*batch)) == float(sharded.train_step(*batch))
    _assert_same(reference, sharded)


@settings(max_examples=examples(ci=20), deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=3), n=st.integers(1, 8))
def test_shards_cut_every_variable_into_contiguous_ring_chunks(
    shape: list[int], n: int
) -> None:
    size = int(np.prod(shape))
    cut = VariableShards(tuple(shape), size, n, "float32")
    owned = [cut.owned(k) for k in range(n)]
    assert sum(owned) == size and max(owned) <= cut.length
    starts = [cut.start(k) for k in range(n) if owned[k]]
    ends = [cut.start(k) + owned[k] for k in range(n) if owned[k]]
    assert starts[:1] in ([], [0]) and starts[1:] == ends[:-1]  # contiguous, in owner order
    # the ring's chunks: equal lengths ceil(size/n); only the last owners come up short
    assert all(o == cut.length for o in owned[: size // cut.length if cut.length else 0])


def test_more_towers_than_elements_leaves_owners_empty() -> None:
    def build() -> keras.Model:
        inp = keras.Input((1,))
        out = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")(inp)
        return keras.Model(inp, out)

    x, y = np.arange(6, dtype="float32")[:, None], np.ones((6, 1), "float32")
    trainers = [
        towers.TowerTrainer(build, keras.optimizers.Adam(0.1), "mse", devices=DEVICES[:5],
                            all_reduce="ring", variables=v)
        for v in ("replicated", "sharded")
    ]  # fmt: skip
    for _ in range(3):
        losses = [float(t.train_step(x, y)) for t in trainers]
        assert losses[0] == losses[1]
    _assert_same(*trainers)
    # kernel and bias have one element each: tower 0 owns both, towers 1–4 hold no slot
    assert [len(r.optimizer.variables) for r in trainers[1].replicas[1:]] == [2] * 4


@pytest.mark.parametrize("n", [4, 8])
def test_optimizer_state_per_tower_is_one_nth(n: int) -> None:
    """Adam keeps 2 float32 slots per element, plus iterations (int64) and the rate (float32)."""
    make = lambda: mlp((64, 96, 10))  # noqa: E731
    sizes = [64 * 96, 96, 96 * 10, 10]
    kw: dict[str, Any] = dict(devices=DEVICES[:n], all_reduce="ring")
    adam = keras.optimizers.Adam
    full = towers.TowerTrainer(make, adam(), loss_fn(), variables="replicated", **kw)
    shard = towers.TowerTrainer(make, adam(), loss_fn(), variables="sharded", **kw)
    scalars = 8 + 4
    assert optimizer_state_bytes(full) == [scalars + 2 * 4 * sum(sizes)] * n
    owned = [sum(VariableShards((s,), s, n, "float32").owned(k) for s in sizes) for k in range(n)]
    assert optimizer_state_bytes(shard) == [scalars + 2 * 4 * o for o in owned]
    assert sum(owned) == sum(sizes)  # no slot for padding, none twice
    assert max(owned) <= sum(-(-s // n) for s in sizes)  # each tower: at most ceil(size/n) each


def _nan_batch(spec: ModelSpec, size: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = spec.batch(size, seed=9)
    x[-1, 0] = np.nan
    return x, y


def test_skipped_step_changes_no_shard_state() -> None:
    spec = ModelSpec("dense")
    reference, sharded = _pair(spec, 3, "momentum")
    batch = spec.batch(7, seed=0)
    reference.train_step(*batch), sharded.train_step(*batch)
    before = [[np.array(v.numpy()) for v in r.optimizer.variables] for r in sharded.replicas]
    plan = sharded.placement.plan
    shards = [[np.array(s.numpy()) for s in row if s is not None] for row in plan.shards]
    sharded.train_step(*_nan_batch(spec, 7))
    assert sharded.skipped_steps == 1 and 2 in sharded.last_step_nonfinite
    after = [[np.array(v.numpy()) for v in r.optimizer.variables] for r in sharded.replicas]
    for b, a in zip(before, after):
        for x, y in zip(b, a):
            np.testing.assert_array_equal(x, y)
    for row, now in zip(shards, plan.shards):
        for x, s in zip(row, [s for s in now if s is not None]):
            np.testing.assert_array_equal(x, s.numpy())
    _assert_same(reference, sharded)  # the skip changed nothing, weights included
    batch = spec.batch(5, seed=1)
    assert float(reference.train_step(*batch)) == float(sharded.train_step(*batch))
    _assert_same(reference, sharded)


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_checkpoint_round_trip_and_tower_count_refused(tmp_path: Any) -> None:
    spec = ModelSpec("dropout")
    batches = [spec.batch(9, seed=k) for k in range(3)]
    first = _trainer(spec, 3)
    for b in batches[:2]:
        first.train_step(*b)
    prefix = checkpoint.save(first, str(tmp_path / "ckpt"))
    first.train_step(*batches[2])
    resumed = _trainer(spec, 3)
    checkpoint.restore(resumed, prefix)
    resumed.train_step(*batches[2])
    for a, b in zip(first.replica_weights(), resumed.replica_weights()):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    assert _slots(first).keys() == _slots(resumed).keys()
    for key, value in _slots(first).items():
        np.testing.assert_array_equal(value, _slots(resumed)[key])
    other = _trainer(spec, 4)
    kept = other.get_weights()
    with pytest.raises(CheckpointError, match="does not match this trainer"):
        checkpoint.restore(other, prefix)
    for x, y in zip(kept, other.get_weights()):
        np.testing.assert_array_equal(x, y)


@pytest.mark.long
def test_set_weights_steps_and_replica_check_work_sharded() -> None:
    spec = ModelSpec("batchnorm")
    reference, sharded = _pair(spec, 4, "adam", check_replicas_every=1)
    weights = [w + 0.5 for w in reference.get_weights()]
    reference.set_weights(weights), sharded.set_weights(weights)
    x, y = spec.batch(22, seed=3)
    for t in (reference, sharded):
        for i in (0, 10, 20):  # one unshuffled epoch in batches of 10
            t.train_step(x[i : i + 10], y[i : i + 10])
    _assert_same(reference, sharded)  # the last batch of 2 leaves towers 2 and 3 empty


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_sparse_gradients_are_densified_by_default_and_match() -> None:
    """sharded's default sparse mode is "densify" (the capability table); "gather" is
    refused at construction, before the model factory runs. Left unset with an optimizer
    whose sparse and dense updates differ (Adam), the Embedding is refused by name
    (tests/guard/test_given.py); asked for, the dense update equals replicated's."""
    spec = ModelSpec("embedding")
    built: list[int] = []

    def counting() -> keras.Model:
        built.append(1)
        return spec.build()

    with pytest.raises(ValueError, match=r"sparse='gather'.*refused.*sparse='densify'"):
        towers.TowerTrainer(counting, SHARDABLE["adam"], loss_fn(), devices=DEVICES[:3],
                            variables="sharded", sparse="gather")  # fmt: skip
    assert built == []
    with pytest.raises(ValueError, match=r"variables='sharded'.*Embedding.*optimizer Adam"):
        towers.TowerTrainer(spec.build, SHARDABLE["adam"], loss_fn(), devices=DEVICES[:3],
                            variables="sharded")  # fmt: skip
    reference = _trainer(spec, 3, variables="replicated", sparse="densify")
    sharded = towers.TowerTrainer(spec.build, SHARDABLE["adam"], loss_fn(), devices=DEVICES[:3],
                                  variables="sharded", sparse="densify")  # fmt: skip
    assert (sharded.sparse, sharded.cell["all_reduce"]) == ("densify", "ring")
    for k in range(2):
        batch = spec.batch(6 + k, seed=k)
        assert float(reference.train_step(*batch)) == float(sharded.train_step(*batch))
    _assert_same(reference, sharded)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(all_reduce="naive"), "variables='sharded' with all_reduce='naive'.*refused"),
        (dict(all_reduce="tree"), "all_reduce='tree'.*refused.*leave all_reduce unset"),
        (dict(all_reduce=ring(subchunks=2)), r"all_reduce=ring\(subchunks=2\).*refused"),
        (dict(all_reduce=towers.bucketed("ring", 1024)), r"all_reduce=bucketed\(ring.*refused"),
        (dict(all_reduce=towers.compressed("ring", "topk")), r"compressed\(ring.*refused"),
        (dict(optimizer=keras.optimizers.SGD(0.1, clipnorm=1.0)), "clipnorm"),
        (dict(optimizer=keras.optimizers.Adam(global_clipnorm=1.0)), "global_clipnorm"),
        (dict(optimizer=keras.optimizers.Adafactor()), "elementwise"),
        (dict(optimizer=keras.optimizers.Lamb()), "elementwise"),
        (dict(optimizer=_excluding_bias()), "exclude_from_weight_decay"),
    ],
)
def test_what_sharding_cannot_do_is_refused(kwargs: dict[str, Any], message: str) -> None:
    spec = ModelSpec("dense")
    kwargs = {"all_reduce": "ring", "optimizer": keras.optimizers.Adam(), **kwargs}
    with pytest.raises(ValueError, match=message):
        towers.TowerTrainer(spec.build, kwargs.pop("optimizer"), loss_fn(), devices=DEVICES[:2],
                            variables="sharded", **kwargs)  # fmt: skip


@pytest.mark.parametrize("mode", [pytest.param("compiled", marks=pytest.mark.long), "eager"])
def test_phases_one_by_one_equal_train_step_bitwise(mode: str) -> None:
    """split -> forward_backward -> reduce (reduce-scatter) -> apply (update, all-gather),
    one phase at a time == train_step, bitwise; 3 examples over 4 towers leave one empty.
    All ``as_written()``: ``forward_graph="as_written"``'s step (tests/test_step.py)."""
    from tests.test_step import _no_fused_kernels, _run_phases, _state

    spec = ModelSpec("batchnorm")
    graph = "default" if mode == "default" else "as_written"
    whole, phases = (_trainer(spec, 4, forward_graph=graph) for _ in range(2))
    with _no_fused_kernels() if mode == "eager" else contextlib.nullcontext():
        for k in range(2):
            batch = spec.batch(3, seed=k)
            loss = float(whole.train_step(*batch))
            assert _run_phases(phases, batch, mode) == loss
    for a, b in zip(_state(whole), _state(phases), strict=True):
        np.testing.assert_array_equal(a, b)
