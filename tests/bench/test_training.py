"""The step table on a small batch: every configuration starts from the same loss."""

from __future__ import annotations

import pytest

from tests.conftest import DEVICES
from towers.bench import training


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return training.run_model("conv-mnist", DEVICES[:2], batch=8, rounds=2, calls=1,
                              algorithms=["naive"], placements=["parameter_device"])


@pytest.mark.long
def test_every_configuration_ran_from_the_same_loss(rows: list[dict]) -> None:
    names = {r["config"] for r in rows}
    assert set(training.BASELINES) <= names
    assert {"towers naive/parameter_device", "towers noop/replicated"} <= names
    assert not [r for r in rows if r["error"]]
    losses = [r["first_loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-5


def test_ratios_are_to_mirrored_and_to_the_best_tf_distribute(rows: list[dict]) -> None:
    mirrored = next(r for r in rows if r["config"] == training.MIRRORED)
    assert mirrored["ratio"] == pytest.approx(1.0)
    best = next(r for r in rows if r["config"] == mirrored["best_tf"])
    assert best["kind"] == "tf.distribute" and best["ratio_best_tf"] == pytest.approx(1.0)
    assert all(r["ms"] > 0 and r["cpu_ms"] >= 0 for r in rows)


def test_nccl_tree_with_one_variable_copy_is_benchmarked() -> None:
    """It used to deadlock (unused receives pruned); nccl.py now keeps them alive."""
    names = training.config_names(["nccl_tree"], ["parameter_device"], ceiling=False)
    steps, errors = training.build_steps("conv-mnist", DEVICES[:2], names, 4, strict=False)
    assert errors == {}
    assert list(steps) == [*training.BASELINES, "towers nccl_tree/parameter_device"]
