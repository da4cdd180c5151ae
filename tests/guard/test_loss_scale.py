"""The reduction-dtype rule: the wire casts only where a gradient's dtype would change."""

from __future__ import annotations

import keras
import pytest

from towers.guard.loss_scale import LossScale


def _model(dtype: str) -> keras.Model:
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1, dtype=dtype)(inputs))
    model.dtype_policy = dtype  # the compute dtype LossScale reads
    return model


@pytest.mark.parametrize(("dtype", "reduce_dtype", "casts"), [
    ("float32", "float32", False),
    ("mixed_float16", "float32", False),  # float32 variables: float32 gradients
    ("float16", "float32", True),  # widened to float32 for the sum
    ("mixed_float16", "compute", True),  # float32 gradients summed in float16
])  # fmt: skip
def test_the_wire_casts_only_where_a_dtype_changes(dtype: str, reduce_dtype: str,
                                                   casts: bool) -> None:  # fmt: skip
    scale = LossScale(keras.optimizers.SGD(0.1), _model(dtype), reduce_dtype)
    assert scale.casts is casts
