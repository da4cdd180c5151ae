"""The step table on a small batch: every configuration starts from the same loss."""

from __future__ import annotations

import pytest

from tests.conftest import DEVICES
from towers.bench import training


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    fused = {"fused(naive)": training.fused_reducers()["fused(naive)"]}
    return training.run_model("conv-mnist", DEVICES[:2], batch=8, rounds=2, calls=1,
                              algorithms=["naive"], placements=["parameter_device"], extra=fused)


def test_every_configuration_ran_from_the_same_loss(rows: list[dict]) -> None:
    names = {r["config"] for r in rows}
    assert set(training.BASELINES) <= names
    assert {"towers naive/parameter_device", "towers noop/replicated",
            "towers fused(naive)/parameter_device"} <= names
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
    x, y = training.make_batch("conv-mnist", 4)
    configs, errors = training.step_configs(
        "conv-mnist", DEVICES[:2], x, y, algorithms=["nccl_tree"],
        placements=["parameter_device"], ceiling=False)
    assert errors == {}
    assert [c.kind for c in configs] == ["baseline"] + ["tf.distribute"] * 3 + ["towers"]


def test_step_targets_follow_the_issue_limits() -> None:
    """<= 0.80 x Mirrored, <= 0.90 and <= 1.00 x the best tf.distribute, <= 1.05 x the
    noop ceiling."""
    from towers.bench import targets

    def row(config: str, kind: str, ratio: float, best: float | None = None) -> dict:
        return {"model": "mlp", "config": config, "kind": kind, "ms": 10.0 * ratio,
                "ratio": ratio, "ratio_best_tf": best, "best_tf": "CentralStorageStrategy"}

    rows = [row("MirroredStrategy", "tf.distribute", 1.0),
            row("towers ring/replicated", "towers", 0.78, 0.92),
            row("towers naive/parameter_device", "towers", 0.85, 0.89),
            row("towers noop/replicated", "ceiling", 0.76)]
    mirrored, best_tf, at_par, noop = targets.targets({"training": rows})
    assert (mirrored["value"], mirrored["limit"], mirrored["holds"]) == (0.78, 0.80, True)
    assert (best_tf["value"], best_tf["limit"], best_tf["holds"]) == (0.89, 0.90, True)
    assert "naive/parameter_device" in best_tf["detail"]
    assert (at_par["value"], at_par["limit"], at_par["holds"]) == (0.89, 1.00, True)
    assert noop["value"] == pytest.approx(0.78 / 0.76) and noop["holds"]  # 1.026 <= 1.05
    rows[-1]["ratio"] = 0.70
    assert not targets.targets({"training": rows})[3]["holds"]  # 1.114 > 1.05
    rows[2]["ratio_best_tf"] = rows[1]["ratio_best_tf"] = 1.01
    assert [t["holds"] for t in targets.targets({"training": rows})[1:3]] == [False, False]
