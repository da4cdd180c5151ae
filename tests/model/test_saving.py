"""``tm.save`` / ``keras.models.load_model`` and ``save_weights`` / ``load_weights`` round-trip.

A loaded TowerModel has the towers options, devices re-resolved on this machine, every
replica's weights and (``replicated``) optimizer state: training on continues bitwise as
the saved model would.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES
from tests.model.helpers import N, assert_replicas_equal, data, network, tower_model
from towers.guard.options import TowerOptions

X, Y = data(20)


@pytest.mark.parametrize("variables", ["replicated"])  # the one with replicas to refill
def test_save_then_load_model_continues_bitwise(variables: str, tmp_path: Path) -> None:
    tm = tower_model(variables, optimizer=keras.optimizers.Adam(0.01), on_nonfinite="raise")
    tm.fit(X, Y, batch_size=10, verbose=0)
    tm.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, towers.TowerModel) and loaded.trainer is not None
    assert loaded.devices == DEVICES[:N]
    assert loaded.trainer.on_nonfinite == "raise"
    assert loaded.trainer.placement.name == variables
    for model in (tm, loaded):  # the first fit broadcasts the loaded replica 0 (and its Adam)
        model.fit(X, Y, batch_size=10, shuffle=False, verbose=0)
    assert_replicas_equal(loaded)
    for a, b in zip(tm.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_refuses_an_algorithm_it_cannot_name(tmp_path: Path) -> None:
    tm = towers.TowerModel(network(), devices=DEVICES[:N], all_reduce=towers.ALGORITHMS["ring"],
                           variables="replicated")
    with pytest.raises(ValueError, match="all_reduce"):
        tm.get_config()


def test_save_refuses_a_reducer_object_and_names_the_ways_out(tmp_path: Path) -> None:
    tm = tower_model("replicated", all_reduce=towers.compressed("ring", "fp16"))
    with pytest.raises(ValueError, match=r"all_reduce=.*cannot be saved in a \.keras file.*"
                                         r"save_weights.*towers\.training\.checkpoint.*module:NAME"):
        tm.save(tmp_path / "m.keras")
    tm.save_weights(tmp_path / "m.weights.h5")  # the way out works


def test_save_refuses_sharded_optimizer_state(tmp_path: Path) -> None:
    tm = tower_model("sharded")
    with pytest.raises(ValueError, match="sharded"):
        tm.save(tmp_path / "m.keras")


def test_the_newer_trainer_options_pass_through_and_survive_a_save(tmp_path: Path) -> None:
    # every TowerTrainer option is a TowerModel argument, saved in its config
    options = {"semantics": "mirrored", "loss_denominator": 12, "forward_graph": "as_written"}
    tm = tower_model("replicated", **options)
    tm.fit(X, Y, batch_size=10, verbose=0)
    assert tm.trainer is not None
    assert tm.trainer.options == tm.options == TowerOptions(
        variables="replicated", all_reduce=tm.options.all_reduce, **options)
    tm.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.trainer.options == tm.trainer.options
    assert loaded.trainer.options.jit_compile is False
    with pytest.raises(ValueError, match=r"TowerModel\(\.\.\., jit_compile=True\)"):
        tower_model("replicated").compile("sgd", "sparse_categorical_crossentropy",
                                          jit_compile=True)


@pytest.mark.long
@pytest.mark.parametrize("variables", ["sharded", "replicated"])
def test_save_weights_then_load_weights_continues_bitwise_with_adam(
    variables: str, tmp_path: Path
) -> None:
    # sharded: every owner's Adam slots (m, v of its shard) and counter are in the file,
    # not replica 0's alone; the resumed run ends where the uninterrupted one ends
    straight = tower_model(variables, optimizer=keras.optimizers.Adam(0.01))
    straight.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    straight.save_weights(tmp_path / "m.weights.h5")
    resumed = tower_model(variables, optimizer=keras.optimizers.Adam(0.01))
    resumed.load_weights(tmp_path / "m.weights.h5")
    for model in (straight, resumed):
        model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_replicas_equal(resumed)
    for a, b in zip(straight.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
