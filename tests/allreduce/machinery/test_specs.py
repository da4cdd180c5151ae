"""towers.allreduce.machinery.specs: a user's ``module:NAME`` wherever an all-reduce is named
— the trainer, TowerModel (and its saved config), the wrappers — as on the command line."""

from __future__ import annotations

import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES
from towers.allreduce import get, hierarchical

LOSS = "sparse_categorical_crossentropy"

STAR = '''
import tensorflow as tf
from towers.allreduce import check_values, combine, finish, send

def star(values, *, op="sum"):
    """Everyone sends to the last tower, which adds in tower order and sends back."""
    devices = check_values(values, op)
    hub = devices[-1]
    with tf.device(hub):
        total = send(values[0], hub)
        for v in values[1:]:
            total = combine(total, send(v, hub), op)
        total = finish(total, op, len(values))
    return [send(total, d) for d in devices]

def make_star():
    return star

SHOUT = "not an algorithm"
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_star.py").write_text(STAR)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_star"
    sys.modules.pop("user_star", None)


def _net() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(5, "tanh")(inputs)))


def _weights(all_reduce: object, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(10, 4)).astype("f4"), rng.integers(0, 3, size=10)
    trainer = towers.TowerTrainer(_net, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:n],
                                  variables="replicated", all_reduce=all_reduce)  # fmt: skip
    for _ in range(2):
        trainer.train_step(x, y)
    return trainer.get_weights()


@pytest.mark.parametrize("n", [1, 3, 5])
def test_a_trainer_takes_module_name_for_an_algorithm_or_its_factory(user_module: str,
                                                                     n: int) -> None:
    star, made = get(f"{user_module}:star"), get(f"{user_module}:make_star")
    assert star is made and star.__name__ == "star"
    # the star adds in tower order on one device, as naive does: bitwise
    for a, b in zip(_weights(f"{user_module}:star", n), _weights("naive", n), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_wrapper_takes_module_name_for_its_inner_algorithm(user_module: str) -> None:
    got = _weights(hierarchical(f"{user_module}:star", "ring", group_size=2), 4)
    want = _weights(hierarchical("naive", "ring", group_size=2), 4)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_tower_model_saves_and_loads_its_module_name(user_module: str, tmp_path: Path) -> None:
    tm = towers.TowerModel(_net(), devices=DEVICES[:3], all_reduce=f"{user_module}:star",
                           variables="replicated")  # fmt: skip
    tm.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    tm.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.options.all_reduce == f"{user_module}:star"
    assert loaded.trainer.algorithm is get(f"{user_module}:star")


@pytest.mark.parametrize(("spec", "error", "match"), [
    ("user_star:SHOUT", TypeError, "is a str, not a callable"),
    ("user_star:nothing", ValueError, "has no 'nothing'"),
    ("no_such_module_here:star", ValueError, "cannot import 'no_such_module_here'"),
])  # fmt: skip
def test_a_bad_module_name_is_refused_at_construction(user_module: str, spec: str,
                                                      error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _weights(spec, 2)
