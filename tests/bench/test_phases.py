"""The per-phase breakdown: op names -> phases, and a real profile of a small step."""

from __future__ import annotations

import argparse
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.bench import phases


@pytest.mark.parametrize(
    "name, expected",
    [
        ("split/strided_slice_3", ("split", None)),
        ("gradient_tape/replica_2/dense_1/MatMul/MatMul", ("forward_backward", 2)),
        ("replica_11/dense/Relu", ("forward_backward", 11)),
        ("gradient_tape/dense_1/MatMul/MatMul", ("forward_backward", 0)),  # tower 0: no scope
        ("guard/cond/then/_0/guard/cond/reduce/concat", ("reduce", None)),
        ("guard/cond/then/_0/guard/cond/apply/sgd/AssignSubVariableOp", ("apply", None)),
        ("guard/IsFinite_11", ("guard", None)),
        ("guard/cond/then/_0/guard/cond/reduce/add_3/_18", ("reduce", None)),  # a _Send
        ("rereplica_1/x", ("forward_backward", 0)),  # a scope must be a whole path component
        ("Const", ("forward_backward", 0)),  # outside every phase scope: tower 0's
        ("Identity_10", ("handoff", None)),  # forward_graph="default": the two functions' seam
    ],
)
def test_op_names_carry_their_phase(name: str, expected: tuple[str, int | None]) -> None:
    assert phases.phase_of(name) == expected


def test_unscoped_steps_fall_back_to_op_types() -> None:
    matmul = phases.phase_of("replica_1/dense/MatMul", "MatMul", scoped=False)
    assert matmul[0] == "forward_backward"
    assert phases.phase_of("CollectiveReduceV2", "CollectiveReduceV2", scoped=False)[0] == "reduce"
    assert phases.phase_of("x", "ResourceApplyGradientDescent", scoped=False)[0] == "apply"


@pytest.mark.parametrize("variables", ["parameter_device", "replicated"])
def test_a_real_step_is_attributed_to_named_phases_only(variables: str) -> None:
    """Every tower shows up, tower 0 (no scope of its own, as MirroredStrategy's replica 0)
    among them, and the phases add up to the total: an accounting, not a guess."""
    def model() -> keras.Model:
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(3)])

    trainer = towers.TowerTrainer(model, keras.optimizers.SGD(0.1),
                                  "sparse_categorical_crossentropy", devices=DEVICES[:3],
                                  all_reduce="ring", variables=variables)
    x = tf.constant(np.random.default_rng(0).normal(size=(12, 8)).astype("float32"))
    y = tf.constant(np.arange(12) % 3)
    trainer.train_step(x, y)
    profile = phases.phase_profile(lambda: trainer.train_step(x, y), steps=2)
    assert set(profile["towers"]) == {0, 1, 2}
    assert all(ms > 0 for ms in profile["towers"].values())
    for phase in ("forward_backward", "reduce", "apply", "guard"):
        assert profile["phases"][phase] > 0, phase
    assert profile["thread_ms"] == pytest.approx(sum(profile["phases"].values()))
    assert profile["phases"]["forward_backward"] == pytest.approx(sum(profile["towers"].values()))


@pytest.mark.long
def test_the_section_writes_table_csv_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(towers=2, models=["mlp"], batch_size=8, quiet=True, out=tmp_path,
                              no_plots=False, placements=["replicated"])
    results: dict = {}
    assert phases.section(args, DEVICES[:2], results)
    configs = [r["config"] for r in results["phases"]]
    assert "MirroredStrategy" in configs and "towers noop/replicated" in configs
    assert all(c.endswith("/replicated") for c in configs if c.startswith("towers "))
    assert "forward_backward" in capsys.readouterr().out
    assert (tmp_path / "phases.csv").stat().st_size > 0
    assert (tmp_path / "phases.png").stat().st_size > 0
