"""ordering: ``as_written()`` restores Grappler's settings; ``forward_graph`` keeps the towers'
kernels those of tf.distribute.

``forward_graph="default"`` compiles the towers' forward/backward under the caller's Grappler
settings and only reduce/apply ``as_written()``: on real Keras models — BatchNorm after linear
convolutions (whose biases get an exactly-zero gradient: rounding noise that Adam turns into
full-size steps), depthwise convolutions, attention with LayerNorm, an LSTM — ``naive`` then
equals MirroredStrategy with ``ReductionToOneDevice`` run as users run it (no ``as_written``)
bitwise, Adam included. ``"as_written"`` compiles the towers' kernels without Grappler's
rewrites and differs (measured on slightly larger models, 8×8×3 inputs and 16 examples:
up to 192 ULPs on a kernel and sign flips on the zero-gradient biases; docs/bounds.md §4;
not asserted here: on some small shapes the two graphs happen to round alike).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from reference import MirroredTrainer
from tests.conftest import DEVICES
from towers.allreduce.machinery.base import REWRITES, as_written
from towers.compile.step import PhasedStep, nests
from towers.split import batch_tensors


def _init(seed: int) -> keras.initializers.Initializer:
    return keras.initializers.GlorotUniform(seed)


def _conv_bn() -> keras.Model:
    inp = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, kernel_initializer=_init(1))(inp)  # its bias: zero gradient
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    h = keras.layers.BatchNormalization()(keras.layers.Conv2D(3, 3, kernel_initializer=_init(2))(h))
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer=_init(3))(
        keras.layers.GlobalAveragePooling2D()(h)))


def _depthwise() -> keras.Model:
    inp = keras.Input((6, 6, 2))
    h = keras.layers.DepthwiseConv2D(3, depthwise_initializer=_init(1))(inp)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    h = keras.layers.Conv2D(3, 1, kernel_initializer=_init(2))(h)
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer=_init(3))(
        keras.layers.GlobalAveragePooling2D()(h)))


def _attention() -> keras.Model:
    inp = keras.Input((5, 8))
    att = keras.layers.MultiHeadAttention(2, 4, kernel_initializer=_init(1))(inp, inp)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([inp, att]))
    f = keras.layers.Dense(8, activation="relu", kernel_initializer=_init(2))(h)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, f]))
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer=_init(3))(
        keras.layers.GlobalAveragePooling1D()(h)))


def _lstm() -> keras.Model:
    inp = keras.Input((5, 4))
    h = keras.layers.LSTM(6, kernel_initializer=_init(1),
                          recurrent_initializer=keras.initializers.Orthogonal(seed=2))(inp)
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer=_init(3))(h))


def _hard_swish() -> keras.Model:
    """MobileNetV3's block: its gradient's bits depend on the ops' names (replica_scope)."""
    inp = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, use_bias=False, kernel_initializer=_init(1))(inp)
    h = keras.layers.Activation("hard_swish")(keras.layers.BatchNormalization()(h))
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer=_init(3))(
        keras.layers.GlobalAveragePooling2D()(h)))


MODELS: dict[str, tuple[Callable[[], keras.Model], tuple[int, ...]]] = {
    "conv_bn": (_conv_bn, (6, 6, 2)), "depthwise": (_depthwise, (6, 6, 2)),
    "attention": (_attention, (5, 8)), "lstm": (_lstm, (5, 4)),
    "hard_swish": (_hard_swish, (6, 6, 2)),
}


def _train(name: str, forward_graph: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two Adam steps of towers' ``naive`` and of MirroredStrategy, neither as_written."""
    make, shape = MODELS[name]
    rng = np.random.default_rng(0)
    opt = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours = towers.TowerTrainer(make, opt, loss, devices=DEVICES[:2], all_reduce="naive",
                               semantics="mirrored", forward_graph=forward_graph)
    theirs = MirroredTrainer(make, opt, loss, DEVICES[:2],
                             cross_device_ops="reduction_to_one_device")
    theirs.set_weights(ours.get_weights())
    for _ in range(2):
        x, y = rng.normal(size=(8, *shape)).astype(np.float32), rng.integers(0, 3, 8)
        assert float(ours.train_step(x, y)) == float(theirs.train_step(x, y))
    return ours.get_weights(), theirs.get_weights()


@pytest.mark.long
@pytest.mark.parametrize("nested", [True, False], ids=["one_call", "two_calls"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_forward_graph_equals_mirrored_strategy_bitwise(
    name: str, nested: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both forms of PhasedStep: one call on CPUs, two on GPUs (forced here on CPUs)."""
    monkeypatch.setattr("towers.compile.step.nests", lambda devices: nested)
    ours, theirs = _train(name, "default")
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


def _chain(xs: list[tf.Tensor]) -> tf.Tensor:
    total = xs[0]
    for x in xs[1:]:
        total = tf.add(total, x)  # Grappler's AddOpsRewrite makes this chain one AddN
    return total / 3.0  # and constant folding this division a multiplication


@pytest.mark.parametrize("nested", [True, False])
def test_phased_step_runs_its_update_as_written_inside_a_default_step(nested: bool) -> None:
    """The update's additions happen in the order written, in both forms of the step,
    although the step itself compiles under Grappler's defaults; the control (the same
    chain inlined in the step) shows that Grappler does reorder it there."""
    rng = np.random.default_rng(0)
    xs = [tf.constant((rng.standard_normal(4096) * 10.0 ** rng.integers(-3, 4, 4096))
                      .astype(np.float32)) for _ in range(6)]  # fmt: skip
    expected = xs[0].numpy()
    for x in xs[1:]:
        expected = expected + x.numpy()  # float32 + float32, left to right
    expected = expected / np.float32(3.0)

    def forward(*xs: tf.Tensor) -> tuple[list[tf.Tensor], None]:
        return [x * 1.0 for x in xs], None  # graph tensors, not constants

    step = PhasedStep(forward, _chain, nested=nested)
    np.testing.assert_array_equal(step(*xs).numpy(), expected)
    # the control: the same update without its barrier (the bench's calibration form)
    inlined = PhasedStep(forward, _chain, barrier=False)
    assert (inlined(*xs).numpy() != expected).any(), "Grappler no longer reorders the control"
    assert not [op for op in inlined.get_concrete_function(*xs).graph.get_operations()
                if op.type in ("PartitionedCall", "StatefulPartitionedCall")]


def test_an_update_without_its_barrier_is_one_call_only() -> None:
    with pytest.raises(ValueError, match="barrier=False needs nested=True"):
        PhasedStep(lambda x: ([x], None), _chain, nested=False, barrier=False)


def test_phased_step_nests_on_cpus_only() -> None:
    assert nests(DEVICES[:3])
    assert nests(["/job:localhost/replica:0/task:0/device:CPU:0"])
    assert not nests(["/cpu:0", "/gpu:0"])
    assert not nests(["/GPU:0", "/GPU:1"])
    trainer = towers.TowerTrainer(_lstm, keras.optimizers.SGD(0.1), "mse", devices=DEVICES[:2])
    assert trainer.compiled.steps[False].nested


def test_the_nested_update_runs_without_the_memory_optimizer() -> None:
    """Grappler's memory optimizer may turn the update's ``AddN`` into ``AssignAdd`` s
    added in arrival order (``towers.compile.step.PhasedStep._step``): the nested call op's
    config turns it off, and keeps the as-written rewrites off."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    trainer = towers.TowerTrainer(_lstm, keras.optimizers.SGD(0.1), "mse", devices=DEVICES[:2])
    x, y = np.zeros((4, 5, 4), "float32"), np.zeros((4, 3), "float32")
    graph = trainer.compiled.steps[False].get_concrete_function(
        *batch_tensors(x, y, None, trainer.model)).graph
    calls = [op for op in graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall")]  # fmt: skip
    assert len(calls) == 1  # the update, nested in the step's one call
    config = config_pb2.ConfigProto.FromString(calls[0].get_attr("config_proto"))
    rewrites = config.graph_options.rewrite_options
    assert rewrites.memory_optimization == rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    assert all(getattr(rewrites, name) == rewriter_config_pb2.RewriterConfig.OFF
               for name in REWRITES)  # fmt: skip


def test_as_written_restores_the_callers_settings() -> None:
    before = tf.config.optimizer.get_experimental_options()
    with as_written():
        inside = tf.config.optimizer.get_experimental_options()
        assert all(inside[name] is False for name in REWRITES)
    assert tf.config.optimizer.get_experimental_options() == before


def test_forward_graph_is_checked() -> None:
    with pytest.raises(ValueError, match="forward_graph"):
        towers.TowerTrainer(_lstm, keras.optimizers.SGD(0.1), "mse", devices=DEVICES[:1],
                            forward_graph="eager")
