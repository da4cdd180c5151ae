"""towers compare, bisect and invariance: verdicts, the reported divergence, exit codes 0/1/2/3.

In-process through ``towers.cli.main``, on the bundled digits (the 64-32-10 MLP, small
batches, few steps) or a user's own step, model, optimizer and data. The user's code is
named on the command line: :func:`make_buggy_step` and :func:`per_replica_trainer` here are
step factories ``(model_fn, optimizer_fn, loss, devices) -> step``; ``tiny_mlp`` is a model
factory. The known divergence is :class:`~tests.testing.test_invariance.DropsATower`,
named through the factory :func:`make_dropper`.
"""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.testing.test_invariance import DropsATower
from towers import cli
from towers.cli.compare import KERNEL_NOISE, exit_code
from towers.testing import as_step

FAST = ["--batch", "8", "--steps", "4"]


def make_dropper() -> DropsATower:
    """A fresh fault each run: tower 1 left out of the second variable (dense bias) at step 3."""
    return DropsATower(step=3, variable=1)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(args))
    except SystemExit as exit_:  # argparse's usage error
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_compare_of_two_honest_algorithms_exits_0(capsys) -> None:
    code, out, _ = _run(capsys, "bisect", "--a", "ring", "--b", "towers:naive", "--towers", "3",
                        "--batch", "8", "--steps", "2")  # fmt: skip
    assert code == 0, out
    assert "bisect ring (A, teacher) vs naive (B), 3 towers, 2 step(s)" in out
    assert "PASS: no step left the bound" in out


def test_compare_finds_the_dropped_tower_and_exits_1(capsys) -> None:
    code, out, _ = _run(capsys, "bisect", "--a", "naive", "--b",
                        "tests.cli.test_compare:make_dropper", "--towers", "2", *FAST)  # fmt: skip
    assert code == 1, out
    # Keras numbers layers per process (dense, dense_1, …): the second variable is a bias
    assert re.search(r"FIRST DIVERGENCE: step 3, variable dense(_\d+)?/bias \(#1, gradient; "
                     r"reduction \(tests\.cli\.test_compare:make_dropper\)\)", out), out
    assert "step 4" not in out  # it stops at the first step outside the bound


def test_invariance_flags_the_dropped_tower_and_exits_1(capsys) -> None:
    code, out, _ = _run(capsys, "invariance", "--towers", "1,2", "--algorithm",
                        "tests.cli.test_compare:make_dropper", *FAST)  # fmt: skip
    assert code == 1, out
    # the step-3 row blames the reduction, no other row does; kernel noise (oneDNN's or
    # Eigen's GEMM blocking by batch size, which differs between CPUs) may mark other rows
    verdicts = {int(m[1]): m[2] for m in re.finditer(r"^\s+2\s+(\d+)\s.*\s(ok|OUTSIDE: .*)$", out,
                                                       re.MULTILINE)}  # fmt: skip
    assert sorted(verdicts) == [1, 2, 3, 4], out
    assert verdicts[3] == "OUTSIDE: reduction (2)", out
    assert all("reduction" not in v for step, v in verdicts.items() if step != 3), out
    # the FAIL line names what the exit code is about, even after earlier kernel noise
    assert re.search(r"FAIL: 2 towers, step 3, dense(_\d+)?/bias: .*\(reduction \(2\)\)", out), out


def test_invariance_of_an_honest_algorithm_exits_0(capsys) -> None:
    code, out, _ = _run(capsys, "invariance", "--towers", "1,2", "--algorithm", "naive",
                        "--batch", "8", "--steps", "2")  # fmt: skip
    # exit 0, or 3 where this CPU's GEMM rounds a shard of 4 differently from a batch of 8
    # (kernel noise, named as such); never 1: an honest all-reduce is never blamed
    assert code in (0, 3), out
    assert "OUTSIDE: reduction" not in out and "(reduction" not in out, out
    if code == 0:
        assert "PASS: every step within its bound" in out
    else:
        assert re.search(r"FAIL: 2 towers, step \d, .*\(kernels\)", out), out
        assert "note: 'kernels'" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["invariance", "--towers", "0,2"], "distinct tower counts in 1..64"),
        (["invariance", "--towers", "2,2"], "distinct tower counts in 1..64"),
        (["invariance", "--towers", "a,b"], "expected tower counts like 1,2,4,8"),
        (["invariance", "--steps", "0"], "must be an integer >= 1"),
        (["invariance", "--lr", "-1"], "must be a finite number > 0"),
        (["invariance", "--model", "resnet"], "invalid choice: 'resnet'"),
        (["invariance", "--algorithm", "no_such"], "unknown"),
        (["invariance", "--batch", "1000", "--steps", "2"], "--batch × --steps must be at most"),
        (["bisect", "--a", "ring"], "required: --b"),
        (["bisect", "--a", "ring", "--b", "towers:mirrored"], "after 'towers:'"),
        (["bisect", "--a", "ring", "--b", "no_such"], "unknown"),
        (["bisect", "--a", "ring", "--b", "naive", "--towers", "0"], "must be an integer >= 1"),
    ],
)
def test_bad_options_exit_2_with_the_reason(args: list[str], message: str, capsys) -> None:
    code, out, err = _run(capsys, *args)
    assert code == 2, out
    assert message in err
    assert "Traceback" not in err


MODEL = ["--model", "tests.testing.test_invariance:tiny_mlp"]


def _one_device_step(model_fn: Any, optimizer_fn: Any, weighting: float) -> Any:
    model, optimizer = model_fn(), optimizer_fn()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @tf.function
    def step(batch: Any) -> tf.Tensor:
        x, y = batch
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(loss_fn(y, model(x)))
            loss = total / (weighting * tf.cast(tf.shape(x)[0], tf.float32))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return as_step(step, model, optimizer=optimizer)


def make_buggy_step(model_fn: Any, optimizer_fn: Any, loss: Any, devices: list[str]) -> Any:
    """A user's step that divides the loss by twice the batch (a weighting bug)."""
    return _one_device_step(model_fn, optimizer_fn, 2.0)


@pytest.fixture
def data(tmp_path: Path) -> str:
    rng = np.random.default_rng(0)
    path = tmp_path / "train.npz"
    np.savez(path, x=rng.uniform(-1, 1, (16, 5)).astype("float32"),
             y=rng.integers(0, 3, 16).astype("int32"))  # fmt: skip
    return str(path)


def test_towers_against_mirrored_on_a_users_model_and_data_exits_0(capsys, data: str) -> None:
    code, out, err = _run(capsys, "compare", "--a", "towers.step:TowerTrainer", "--b",
                          "reference:MirroredTrainer", "--towers", "2", *MODEL, "--data", data,
                          "--batch", "8", "--steps", "2")  # fmt: skip
    assert code == 0, out + err
    assert "compare TowerTrainer(parameter_device) (A, teacher) vs MirroredTrainer (B)" in out
    assert "bound: sgd_step_bound" in out and "PASS" in out


def test_a_users_weighting_bug_exits_1_naming_step_variable_and_values(capsys, data: str) -> None:
    code, out, _ = _run(capsys, "bisect", "--a", "towers.step:TowerTrainer", "--b",
                        "tests.cli.test_compare:make_buggy_step", "--towers", "1", *MODEL,
                        "--data", data, "--batch", "8", "--steps", "2")  # fmt: skip
    assert code == 1, out
    assert "FIRST DIVERGENCE: step 1, variable dense" in out and "A = " in out and "B = " in out


def test_other_optimizers_need_a_bound(capsys, data: str) -> None:
    args = ["compare", "--a", "ring", "--b", "mirrored", "--towers", "2", *MODEL, "--data",
            data, "--batch", "8", "--steps", "1", "--optimizer", "ftrl", "--lr", "0.001"]
    code, out, err = _run(capsys, *args)
    assert code == 2 and "pass bound=" in err and len(err.strip().splitlines()) == 1
    code, out, _ = _run(capsys, *args, "--bound", "1e-6")
    assert code == 0, out
    assert "bound: tolerance 1e-06 (given as bound=)" in out


def test_kernel_noise_has_its_own_exit_code() -> None:
    first = types.SimpleNamespace(cause="kernels")
    assert exit_code(types.SimpleNamespace(ok=False, first=first)) == KERNEL_NOISE == 3
    assert exit_code(types.SimpleNamespace(ok=False, first=types.SimpleNamespace(cause=""))) == 1
    assert exit_code(types.SimpleNamespace(ok=False, reduction_ok=True)) == KERNEL_NOISE
    assert exit_code(types.SimpleNamespace(ok=False, reduction_ok=False)) == 1
    assert exit_code(types.SimpleNamespace(ok=True)) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare", "--a", "ring"], "required: --b"),
        (["compare", "--a", "ring", "--b", "naive", "--model", "resnet"], "invalid choice"),
        (["compare", "--a", "ring", "--b", "naive", "--data", "no.npz"], "existing .npz file"),
        (["compare", "--a", "ring", "--b", "naive", "--optimizer", "nope"], "--optimizer/--loss"),
        (["compare", "--a", "ring", "--b", "no_such_module:make"], "cannot import"),
        (["invariance", "--model", "no_such_module:fn"], "cannot import"),
    ],
    ids=["missing-b", "model", "data", "optimizer", "factory", "invariance-model"],
)
def test_usage_errors_exit_2_with_one_line(args: list[str], message: str, capsys) -> None:
    code, out, err = _run(capsys, *args)
    assert code == 2, out
    assert message in err and "Traceback" not in err


def per_replica_trainer(model_fn: Any, optimizer_fn: Any, loss: Any, devices: list[str]) -> Any:
    """towers with the tutorial's denominator: not invariant on an uneven batch."""
    from towers import TowerTrainer

    return TowerTrainer(model_fn, optimizer_fn, loss, devices=devices, all_reduce="ring",
                        variables="replicated", semantics="mirrored")  # fmt: skip


def test_invariance_of_a_users_step_factory(capsys, data: str) -> None:
    common = ["invariance", "--towers", "1,3", *MODEL, "--data", data, "--batch", "5",
              "--steps", "1"]  # 5 over 3 towers: 2+2+1
    code, out, _ = _run(capsys, *common, "--step", "reference:MirroredTrainer")
    assert code == 0, out
    code, out, _ = _run(capsys, *common, "--step", "tests.cli.test_compare:per_replica_trainer")
    assert code == 1 and "FAIL: 3 towers, step 1" in out, out
