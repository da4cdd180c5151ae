"""towers.step: placements, replicas, non-trainable state, bad input, tracing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES, examples
from tests.strategies import OPTIMIZERS
from towers.allreduce.machinery.primitives import traffic_kind
from towers.testing import ModelSpec, loss_fn


def _trainer(spec: ModelSpec, n: int, **kwargs: object) -> towers.TowerTrainer:
    kwargs.setdefault("all_reduce", "naive")
    return towers.TowerTrainer(
        spec.build,
        OPTIMIZERS[str(kwargs.pop("optimizer", "adam"))],
        loss_fn(),
        devices=DEVICES[:n],
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.long
@settings(max_examples=examples(ci=6))
@given(
    family=st.sampled_from(["dense", "embedding", "batchnorm", "dropout", "regularized"]),
    n=st.integers(2, 5),
    steps=st.integers(1, 3),
    algorithm=st.sampled_from(["naive", "parameter_device"]),
)
def test_replicas_stay_bitwise_identical(family: str, n: int, steps: int, algorithm: str) -> None:
    spec = ModelSpec(family)
    trainer = _trainer(spec, n, variables="replicated", all_reduce=algorithm)
    for k in range(steps):
        trainer.train_step(*spec.batch(2 * n + k, seed=k))
    copies = trainer.replica_weights()
    assert len(copies) == n
    for replica in copies[1:]:
        for a, b in zip(copies[0], replica):
            np.testing.assert_array_equal(a, b)
    assert all(len(r.model.variables) for r in trainer.replicas)
    for r, d in zip(trainer.replicas, DEVICES[:n]):
        assert all(v.value.device.endswith(d.split("device:")[1]) for v in r.model.variables)


def test_both_placements_agree_bitwise() -> None:
    spec = ModelSpec("regularized")
    a = _trainer(spec, 3, variables="parameter_device")
    b = _trainer(spec, 3, variables="replicated")
    for k in range(2):
        batch = spec.batch(7, seed=k)
        assert float(a.train_step(*batch)) == float(b.train_step(*batch))
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(x, y)


def test_one_trace_per_input_signature() -> None:
    spec = ModelSpec("dense")
    trainer = _trainer(spec, 2)
    for k in range(4):
        trainer.train_step(*spec.batch(6, seed=k))
    assert trainer.trace_count == 1


def _bn_trainer(mode: str, n: int = 4) -> towers.TowerTrainer:
    def make() -> keras.Model:
        inp = keras.Input((1,))
        out = keras.layers.BatchNormalization(momentum=0.5)(inp)
        return keras.Model(inp, keras.layers.Dense(1)(out))

    return towers.TowerTrainer(
        make,
        keras.optimizers.SGD(0.0),
        "mse",
        devices=DEVICES[:n],
        variables="replicated",
        all_reduce="naive",
        semantics=mode,
    )


def test_non_trainable_mean_averages_tower_updates() -> None:
    x = np.arange(8, dtype="float32")[:, None]
    trainer = _bn_trainer("one_device")
    trainer.train_step(x, np.zeros([8, 1], "float32"))
    means = [float(w[2][0]) for w in trainer.replica_weights()]  # gamma, beta, moving_mean
    # Each shard of 2 has mean 0.5, 2.5, 4.5, 6.5; momentum 0.5 from 0 -> half of it; averaged.
    assert means == [0.5 * np.mean([0.5, 2.5, 4.5, 6.5])] * 4


def test_non_trainable_mean_skips_empty_towers() -> None:
    trainer = _bn_trainer("one_device")
    trainer.train_step(np.array([[2.0], [4.0]], "float32"), np.zeros([2, 1], "float32"))
    assert float(trainer.get_weights()[2][0]) == 0.5 * 3.0  # two towers of one example


def test_mirrored_semantics_keeps_the_first_towers_state_as_mirrored_reads_show() -> None:
    x = np.arange(8, dtype="float32")[:, None]
    trainer = _bn_trainer("mirrored")
    trainer.train_step(x, np.zeros([8, 1], "float32"))
    assert float(trainer.get_weights()[2][0]) == 0.25  # tower 0's shard [0, 1] × 0.5


def test_sparse_gradients_stay_sparse() -> None:
    spec = ModelSpec("embedding")
    trainer = _trainer(spec, 3)
    trainer.train_step(*spec.batch(6, seed=0))
    assert trainer.last_trace_stats is not None
    notes = {t.note for t in trainer.last_trace_stats.transfers}
    assert "sparse-gather" in notes


def test_instances_are_accepted_and_trained() -> None:
    spec = ModelSpec("dense")
    model = spec.build()
    before = [w.copy() for w in model.get_weights()]
    trainer = towers.TowerTrainer(
        model, keras.optimizers.SGD(0.1), loss_fn(), devices=DEVICES[:2], all_reduce="naive"
    )
    trainer.train_step(*spec.batch(4, seed=0))
    assert any(not np.array_equal(a, b) for a, b in zip(before, trainer.get_weights()))
    trainer.set_weights(before)
    for a, b in zip(before, trainer.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"devices": []}, ValueError, "devices is empty"),
        ({"devices": [DEVICES[0], DEVICES[0]]}, ValueError, "appears twice"),
        ({"devices": ["/device:CPU:99"]}, ValueError, "unknown device"),
        ({"devices": "/device:CPU:0"}, TypeError, "list of device names"),
        ({"variables": "zero3"}, ValueError, "variables must be one of"),
        ({"all_reduce": "carrier_pigeon"}, ValueError, r"registered: .*naive"),
        ({"semantics": "sum"}, ValueError, "semantics must be one of one_device, mirrored"),
        ({"parameter_device": "/device:CPU:42"}, ValueError, "unknown device"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    args: dict[str, object] = {"devices": DEVICES[:2], **kwargs}
    with pytest.raises(error, match=match):
        towers.TowerTrainer(ModelSpec("dense").build, keras.optimizers.SGD(0.1), loss_fn(), **args)  # type: ignore[arg-type]


def test_bad_step_inputs() -> None:
    spec = ModelSpec("dense")
    trainer = _trainer(spec, 2)
    x, y = spec.batch(4, seed=0)
    with pytest.raises(ValueError, match="share their batch size"):
        trainer.train_step(x, y[:3])
    with pytest.raises(ValueError, match="share their batch size"):
        trainer.train_step(x, y, sample_weight=np.ones(5, "float32"))
    with pytest.raises(ValueError, match="batch is empty"):
        trainer.train_step(x[:0], y[:0])


def test_scalar_loss_and_frozen_model_are_refused() -> None:
    spec = ModelSpec("dense")
    trainer = towers.TowerTrainer(
        spec.build, keras.optimizers.SGD(0.1), lambda y, p: keras.ops.mean(p), devices=DEVICES[:2]
    )
    with pytest.raises(ValueError, match="one value per example"):
        trainer.train_step(*spec.batch(4, seed=0))

    def frozen() -> keras.Model:
        model = spec.build()
        model.trainable = False
        return model

    with pytest.raises(ValueError, match="no trainable variables"):
        towers.TowerTrainer(frozen, keras.optimizers.SGD(0.1), loss_fn(), devices=DEVICES[:2])


def test_unbuilt_model_instance_is_refused() -> None:
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not built"):
        towers.TowerTrainer(model, keras.optimizers.SGD(0.1), loss_fn(), devices=DEVICES[:2])


def test_sample_weight_scales_the_loss() -> None:
    spec = ModelSpec("dense")
    x, y = spec.batch(6, seed=0)
    plain = _trainer(spec, 3, optimizer="sgd")
    weighted = _trainer(spec, 3, optimizer="sgd")
    half = float(weighted.train_step(x, y, sample_weight=np.full(6, 0.5, "float32")))
    assert half == pytest.approx(0.5 * float(plain.train_step(x, y)), rel=1e-6)


def test_empty_towers_contribute_exact_zeros() -> None:
    """2 examples over 3 towers == over 2 towers, bitwise: (g0 + g1) + 0 == g0 + g1.

    Conv2D is the hard case: Keras 3's Conv2D fails on a batch of 0, so the empty tower
    must skip the model (the reference cannot run this at all)."""
    spec = ModelSpec("conv")
    batch = spec.batch(2, seed=0)
    three = _trainer(spec, 3, optimizer="adam")
    two = _trainer(spec, 2, optimizer="adam")
    assert float(three.train_step(*batch)) == float(two.train_step(*batch))
    for a, b in zip(three.get_weights(), two.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_step_stats_name_every_source() -> None:
    spec = ModelSpec("dense")
    trainer = _trainer(spec, 3, variables="replicated", all_reduce="ring")
    trainer.train_step(*spec.batch(6, seed=0))
    stats = trainer.last_step_stats
    assert stats is not None
    assert set(stats.bytes_per_tower) == set(DEVICES[:3])
    assert not stats.estimated
    # ring: each tower sends 2(n-1)/n of every gradient (padded to n chunks) and no weights.
    from towers.allreduce.ring import ring

    expected = sum(ring().bytes_sent(3, int(v.size) * 4, 4)[0] for v in trainer.get_weights())
    # the tower's loss, example count and non-finite guard code (4 + 4 + 4 bytes)
    assert stats.gradient_bytes_per_tower[DEVICES[1]] == expected
    assert stats.bookkeeping_bytes_per_tower[DEVICES[1]] == 12
    assert stats.bytes_per_tower[DEVICES[1]] == expected + 12
    assert stats.weight_bytes_per_tower == {}  # replicated: no weight reads
    assert stats.gradient_bytes == 3 * expected
    kinds = {t.note: traffic_kind(t.note) for t in stats.transfers}
    assert {n for n, k in kinds.items() if k == "bookkeeping"} == {"loss", "state", "guard"}


def test_step_stats_count_weight_reads_apart() -> None:
    spec = ModelSpec("dense")
    trainer = _trainer(spec, 2, variables="parameter_device", all_reduce="ring")
    trainer.train_step(*spec.batch(4, seed=0))
    stats = trainer.last_step_stats
    assert stats is not None
    weights = sum(int(v.size) * 4 for v in trainer.get_weights())
    assert stats.weight_bytes_per_tower == {DEVICES[0]: weights}  # tower 1 reads them
    for device, total in stats.bytes_per_tower.items():
        parts = (stats.gradient_bytes_per_tower, stats.bookkeeping_bytes_per_tower,
                 stats.weight_bytes_per_tower)
        assert sum(p.get(device, 0) for p in parts) == total


def test_return_outputs_gives_this_steps_predictions_in_tower_order() -> None:
    spec = ModelSpec("dense")
    trainer = _trainer(spec, 3, optimizer="sgd")
    x, y = spec.batch(7, seed=0)  # 3, 3, 1 over the towers
    before = trainer.model(x).numpy()  # the weights this step reads
    loss, outputs = trainer.train_step(x, y, return_outputs=True)
    assert outputs.shape == (7, spec.classes)
    np.testing.assert_allclose(outputs.numpy(), before, rtol=1e-6, atol=1e-7)
    assert float(loss) > 0


# -- the public phases ------------------------------------------------------------------------


def _run_phases(trainer: towers.TowerTrainer, batch: tuple, mode: str) -> float:
    """One step as its four phases: eagerly, or each phase in its own tf.function, all
    ``as_written()``, or (``"default"``) split and forward_backward under Grappler's
    defaults and only reduce and apply ``as_written()``."""
    import tensorflow as tf

    from towers.allreduce import as_written

    def wrap(fn):  # type: ignore[no-untyped-def]
        return fn if mode == "eager" else tf.function(fn, autograph=False)

    with contextlib.nullcontext() if mode == "default" else as_written():
        shards = wrap(trainer.split)(*batch)
        grads = wrap(trainer.forward_backward)(shards)
    with as_written():
        reduced = wrap(trainer.reduce)(grads)
        wrap(trainer.apply)(reduced)
    return float(reduced.loss)


def _state(trainer: towers.TowerTrainer) -> list[np.ndarray]:
    """Every replica's weights and optimizer variables."""
    out = [w for replica in trainer.replica_weights() for w in replica]
    return out + [np.asarray(v.numpy()) for r in trainer.replicas for v in r.optimizer.variables]


@contextlib.contextmanager
def _no_fused_kernels() -> Iterator[None]:
    """Grappler's remapper fuses e.g. MatMul+BiasAdd into one kernel inside a tf.function;
    eager ops are never fused, so an eager forward/backward rounds differently. Without
    the fusion both run the same kernels."""
    import tensorflow as tf

    before = tf.config.optimizer.get_experimental_options().get("remapping")
    tf.config.optimizer.set_experimental_options({"remapping": False})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"remapping": before})


@pytest.mark.long
@pytest.mark.parametrize("placement", ["parameter_device", "replicated"])
@pytest.mark.parametrize("mode", ["compiled", "eager"])
@pytest.mark.parametrize(
    ("family", "size", "n"),
    [("batchnorm", 8, 3), ("batchnorm", 3, 4), ("conv", 2, 3), ("embedding", 5, 3)],
)
def test_phases_one_by_one_equal_train_step_bitwise(
    placement: str, mode: str, family: str, size: int, n: int
) -> None:
    """split -> forward_backward -> reduce -> apply, called one at a time (each in its own
    tf.function, or eagerly) == train_step, bitwise: weights, optimizer state and loss.
    All four ``as_written()`` give ``forward_graph="as_written"``'s step; the first two
    under Grappler's defaults give the default step's (``towers.compile.step.FORWARD_GRAPHS``).
    Batches of 3 over 4 towers and 2 over 3 leave the last tower empty."""
    spec = ModelSpec(family)
    kwargs = {"variables": placement, "all_reduce": "ring", "optimizer": "adam",
              "forward_graph": "default" if mode == "default" else "as_written"}
    whole, phases = (_trainer(spec, n, **kwargs) for _ in range(2))
    with _no_fused_kernels() if mode == "eager" else contextlib.nullcontext():
        for k in range(2):
            batch = spec.batch(size, seed=k)
            loss = float(whole.train_step(*batch))
            assert _run_phases(phases, batch, mode) == loss
    for a, b in zip(_state(whole), _state(phases), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.long
@pytest.mark.parametrize(
    ("family", "size", "n", "placement"),
    [("batchnorm", 3, 4, "replicated"), ("embedding", 5, 3, "parameter_device")],
)
def test_phases_one_by_one_equal_the_default_graph_step_bitwise(
    family: str, size: int, n: int, placement: str
) -> None:
    """As above for ``forward_graph="default"`` (split and forward_backward under Grappler's
    defaults): an empty tower's unchanged state and an Embedding's ``IndexedSlices`` cross
    the two functions' boundary as the one-function step keeps them."""
    test_phases_one_by_one_equal_train_step_bitwise(placement, "default", family, size, n)


def test_phases_hand_over_small_typed_values() -> None:
    spec = ModelSpec("batchnorm")
    trainer = _trainer(spec, 4, variables="replicated")
    shards = trainer.split(*spec.batch(3, seed=0))
    assert shards.sizes == [1, 1, 1, 0] and int(shards.global_batch) == 3
    grads = trainer.forward_backward(shards)
    assert len(grads.towers) == 4 and [int(r.examples) for r in grads.towers] == [1, 1, 1, 0]
    assert len(grads.grads[3]) == len(trainer.model.trainable_variables)
    reduced = trainer.reduce(grads)
    assert len(reduced.grads) == 4  # one list per replica
    assert len(reduced.non_trainable) == len(trainer.model.non_trainable_variables)
    trainer.apply(reduced)
    assert int(trainer.optimizer.iterations) == 1


@pytest.mark.long
@pytest.mark.parametrize(
    ("change", "error", "fragment"),
    [
        (lambda w: w[:-1], ValueError, r"expected 8 arrays \(model.weights\), got 7"),
        (lambda w: [*w[:-1], np.zeros([4], "float32")], ValueError,
         r"weights\[7\] \(variable dense\w*/bias, float32\[3\]\): got shape \[4\]"),
        (lambda w: [*w[:-1], np.array(["a", "b", "c"])], TypeError,
         r"weights\[7\].*expected numbers"),
        (lambda w: w[0], TypeError, "weights must be a list of arrays"),
    ],
    ids=["count", "shape-of-the-last", "strings", "one-array"],
)  # fmt: skip
def test_set_weights_checks_every_array_before_assigning_any(
    change: object, error: type, fragment: str
) -> None:
    spec = ModelSpec("batchnorm")  # 8 weights: Dense (2), BatchNorm (4), Dense (2)
    trainer = _trainer(spec, 3, variables="replicated")
    trainer.train_step(*spec.batch(6, seed=0))
    before = trainer.replica_weights()
    good = [w + 1 for w in trainer.get_weights()]
    with pytest.raises(error, match=fragment):
        trainer.set_weights(change(good))  # type: ignore[operator]
    for now, then in zip(trainer.replica_weights(), before):
        for a, b in zip(now, then):
            np.testing.assert_array_equal(a, b)
