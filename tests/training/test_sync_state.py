"""Non-trainable state is combined by its meaning (towers.placement.AGGREGATIONS),
over the class.

A layer keeps a running count of the examples it saw and a running sum of its inputs,
declared with Keras's ``aggregation``; one device on the whole batch is the reference:

- ``sum``: every tower adds its shard's share, so the total is one device's (integers
  exact; the inputs are small integers in float32, so the float sums are exact too);
- ``only_first_replica``: tower 0's shard alone;
- ``mean`` (and float ``none``, BatchNorm's statistics): the towers' mean over those
  that saw examples;
- integer state with no aggregation that the towers change is refused when traced,
  naming the variable, and nothing changes.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES, examples


class Running(keras.layers.Layer):
    """Counts the examples and sums the inputs it saw in training."""

    def __init__(self, aggregation: str, dtype_: str, **kw: object) -> None:
        super().__init__(**kw)
        self.aggregation, self.dtype_ = aggregation, dtype_

    def build(self, shape: tuple) -> None:
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    dtype=self.dtype_, aggregation=self.aggregation,
                                    name="seen")  # fmt: skip
        self.total = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False,
                                     dtype=self.dtype_, aggregation=self.aggregation,
                                     name="total")  # fmt: skip

    def call(self, x: object, training: bool = False) -> object:
        if training:
            self.seen.assign_add(keras.ops.cast(keras.ops.shape(x)[0], self.dtype_))
            self.total.assign_add(keras.ops.cast(keras.ops.sum(x, axis=0), self.dtype_))
        return x


def _model(aggregation: str, dtype: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    h = Running(aggregation, dtype, name="running")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(h))


def _state(model: keras.Model) -> tuple[np.ndarray, np.ndarray]:
    layer = model.get_layer("running")
    return np.asarray(layer.seen.numpy()), np.asarray(layer.total.numpy())


@pytest.mark.long
@settings(max_examples=examples(ci=6))
@given(
    aggregation=st.sampled_from(["sum", "only_first_replica", "mean"]),
    dtype=st.sampled_from(["int32", "float32"]),
    n=st.integers(1, 6),
    batches=st.lists(st.integers(1, 13), min_size=1, max_size=3),
    variables=st.sampled_from(["replicated", "parameter_device"]),
)
def test_state_is_combined_by_its_declared_aggregation(
    aggregation: str, dtype: str, n: int, batches: list[int], variables: str
) -> None:
    if aggregation == "mean" and dtype == "int32":
        dtype = "float32"  # an integer mean has no rule: refused (the next test)
    trainer = towers.TowerTrainer(_model(aggregation, dtype), keras.optimizers.SGD(0.1), "mse",
                                  devices=DEVICES[:n], all_reduce="naive",
                                  variables=variables)  # fmt: skip
    rng = np.random.default_rng(len(batches))
    want_seen, want_total = 0.0, np.zeros(3)
    for b in batches:
        x = rng.integers(-3, 4, size=(b, 3)).astype("f4")
        y = rng.normal(size=(b, 2)).astype("f4")
        sizes = list(trainer.split(x, y).sizes)
        starts = np.cumsum([0, *sizes])
        parts = [x[starts[i]:starts[i + 1]] for i in range(n)]
        if aggregation == "sum":
            want_seen, want_total = want_seen + b, want_total + x.sum(0)
        elif aggregation == "only_first_replica":
            want_seen, want_total = want_seen + sizes[0], want_total + parts[0].sum(0)
        else:
            seen = [p for p in parts if len(p)]
            want_seen = want_seen + np.mean([len(p) for p in seen])
            want_total = want_total + np.mean([p.sum(0) for p in seen], axis=0)
        trainer.train_step(x, y)
    seen, total = _state(trainer.model)
    if aggregation == "mean":  # a mean of exact sums: one rounding of the division
        np.testing.assert_allclose(seen, want_seen, rtol=1e-6)
        np.testing.assert_allclose(total, want_total, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(seen, np.asarray(want_seen, dtype))
        np.testing.assert_array_equal(total, np.asarray(want_total, dtype))
    for replica in trainer.replica_weights():  # every replica holds the same state
        for got, want in zip(replica, trainer.get_weights(), strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [1, 3])
def test_changed_integer_state_without_a_rule_is_refused_naming_it(n: int) -> None:
    trainer = towers.TowerTrainer(_model("none", "int32"), keras.optimizers.SGD(0.1), "mse",
                                  devices=DEVICES[:n], all_reduce="naive")  # fmt: skip
    before = trainer.get_weights()
    x, y = np.ones((6, 3), "f4"), np.ones((6, 2), "f4")
    with pytest.raises(ValueError, match=r"non-trainable variable 'running/seen' \(int32\).*"
                                         r"aggregation=.*'sum'"):
        trainer.train_step(x, y)
    for a, b in zip(trainer.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
