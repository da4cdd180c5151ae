"""towers check: the verdict, the smallest failing example, exit codes, factories.

Runs in-process through ``towers.cli.main``; ``--max-towers 8`` matches the 8
devices conftest configured, so ``simulate_devices`` is a no-op here. The
broken algorithms under test live in this module and are named ``tests.cli.test_check:…``;
the correct star is conftest's ``user_module``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import tensorflow as tf

from towers import cli
from towers.allreduce import check_values, combine, finish, scheduled, send
from towers.schedule import Schedule, ring_schedule


def forgets_the_last(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Broken: the last tower's value never reaches the sum."""
    devices = check_values(values, op)
    with tf.device(devices[0]):
        total = values[0]
        for v in values[1:-1]:
            total = combine(total, send(v, devices[0]), op)
    return [send(total, d) for d in devices]


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = cli.main(["check", *args, "--max-towers", "8"])
    except SystemExit as exit_:  # a usage error, found while parsing
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", ["star", "make_star"])
def test_a_correct_algorithm_passes_with_exit_code_0(name: str, user_module: str,
                                                     capsys) -> None:
    code, out, _ = _check(capsys, f"{user_module}:{name}", "--towers", "1,2,3",
                          "--examples", "6")
    assert code == 0, out
    assert f"PASS: {user_module}:{name} (6 examples run)" in out
    assert "tower count" in out  # the progress bar


def test_a_broken_algorithm_fails_with_the_smallest_example(capsys) -> None:
    code, out, _ = _check(capsys, "tests.cli.test_check:forgets_the_last", "--examples", "16",
                          "--dtypes", "float32", "--ops", "sum")
    assert code == 1
    assert "FAIL: tests.cli.test_check:forgets_the_last" in out
    example = out.split("Smallest failing example:")[1]
    assert example.lstrip().startswith("n=2 towers, shape=(), dtype=float32, op='sum'")
    assert "output 0: 1 of 1 elements differ" in out


def test_registered_names_work_too(capsys) -> None:
    code, out, _ = _check(capsys, "ring", "--towers", "4", "--examples", "3", "--replay")
    assert code == 0 and "PASS: ring (3 examples run)" in out
    assert "replay not checked" not in out


@pytest.mark.parametrize("name", ["nccl", "nccl_ring", "nccl_tree"])
def test_replay_of_an_opaque_collective_fails_with_the_reason(name: str, capsys) -> None:
    code, out, _ = _check(capsys, name, "--towers", "2", "--examples", "2", "--replay")
    assert code == 1, out
    assert f"FAIL: {name}" in out and "PASS" not in out
    assert f"replay impossible: {name} is not replayable (opaque collective ops" in out


def sums_with_reduce_sum(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Correct, through tf.reduce_sum: an op the NumPy replay has no kernel for."""
    devices = check_values(values, op)
    with tf.device(devices[0]):
        stacked = tf.stack([send(v, devices[0]) for v in values])
        total = finish(tf.reduce_sum(stacked, axis=0), op, len(values))
    return [send(total, d) for d in devices]


def test_replay_that_cannot_follow_the_graph_fails_with_the_reason(capsys) -> None:
    args = ("tests.cli.test_check:sums_with_reduce_sum", "--towers", "2", "--examples", "2",
            "--ops", "sum,mean", "--dtypes", "float32")
    code, out, _ = _check(capsys, *args)
    assert code == 0, out
    code, out, _ = _check(capsys, *args, "--replay")
    assert code == 1 and "replay impossible:" in out and "'Sum'" in out, out


def _gathering_early(n: int) -> Schedule:
    """Broken: the ring's all-gather starts in the last reduce-scatter tick."""
    ticks = [list(tick) for tick in ring_schedule(n).ticks]
    for t in range(n - 1, len(ticks)):
        ticks[t - 1] += ticks[t]
    return Schedule("ring_gathering_early", n, n, tuple(map(tuple, ticks[: max(n - 1, 0)])))


gathering_early = scheduled(_gathering_early)


def test_a_schedule_is_proved_before_it_runs(capsys) -> None:
    code, out, _ = _check(capsys, "swing", "--towers", "3", "--examples", "2")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("PROVED: swing for 64 tower counts (n=1..64) in ")
    assert "PASS: swing (2 examples run)" in out


def test_a_wrong_schedule_is_rejected_with_the_smallest_n_and_tick_drawn(capsys) -> None:
    code, out, _ = _check(capsys, "tests.cli.test_check:gathering_early", "--prove", "16")
    assert code == 1, out
    assert out.startswith("REJECTED: ring_gathering_early: smallest failing n=2, tick 0: send "
                          "before receipt: tower 0 copies chunk 0 to tower 1")
    assert "contributions held when tick 0 begins" in out and "✗ 0 ─c0▶ 1" in out
    assert "examples" not in out  # nothing ran on devices


def test_prove_0_skips_the_proof(capsys) -> None:
    code, out, _ = _check(capsys, "swing", "--towers", "2", "--examples", "2", "--prove", "0")
    assert code == 0 and "PROVED" not in out and "PASS: swing" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["butterfly"], "argument algorithm: unknown algorithm 'butterfly'"),
        (["tests.cli.test_check:nothing"], "has no 'nothing'"),
        (["ring", "--towers", "9"], "argument --towers: 9 is more than --max-towers 8"),
        (["ring", "--dtypes", "float33"], "argument --dtypes: unknown dtype 'float33'"),
        (["swing", "--prove", "-1"], "argument --prove: must be an integer >= 0"),
    ],
)
def test_bad_input_exits_2_with_a_message(args: list[str], message: str, capsys) -> None:
    code, _, err = _check(capsys, *args)
    assert code == 2 and message in err


def test_help_describes_every_option(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    text = capsys.readouterr().out
    for option in ("--max-towers", "--towers", "--examples", "--ops", "--dtypes", "--seed",
                   "--prove", "--replay", "examples:"):
        assert option in text


@pytest.mark.parametrize(
    ("source", "raised"),
    [('def star(values, *, op="sum":\n    pass\n', "SyntaxError"),
     ("x = 1 / 0\n", "ZeroDivisionError")],
)
def test_a_module_that_fails_to_import_is_a_usage_error(source: str, raised: str, tmp_path,
                                                         capsys) -> None:  # fmt: skip
    """Whatever the user's module raises while importing, not only ImportError."""
    path = tmp_path / f"broken_{raised.lower()}.py"
    path.write_text(source)
    code, _, err = _check(capsys, f"{path}:star")
    assert code == 2, err
    assert f"cannot import {str(path)!r}" in err and raised in err, err
    assert len(err.strip().splitlines()) == 1, err
