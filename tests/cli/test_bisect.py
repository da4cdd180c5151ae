"""towers bisect and towers invariance: verdicts, the reported divergence, exit codes 0/1/2.

Runs in-process through ``towers.cli.main`` on the bundled digits (the 64-32-10 MLP,
small batches, few steps). The known divergence is
:class:`~tests.testing.test_invariance.DropsATower`, named on the command line through
the factory :func:`make_dropper` (``tests.cli.test_bisect:make_dropper``).
"""

from __future__ import annotations

import re

import pytest

from tests.testing.test_invariance import DropsATower
from towers import cli

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


def test_bisect_of_two_honest_algorithms_exits_0(capsys) -> None:
    code, out, _ = _run(capsys, "bisect", "--a", "ring", "--b", "towers:naive", "--towers", "3",
                        "--batch", "8", "--steps", "2")  # fmt: skip
    assert code == 0, out
    assert "bisect ring (A, teacher) vs naive (B), 3 towers, 2 step(s)" in out
    assert "PASS: no step left the bound" in out


def test_bisect_finds_the_dropped_tower_and_exits_1(capsys) -> None:
    code, out, _ = _run(capsys, "bisect", "--a", "naive", "--b",
                        "tests.cli.test_bisect:make_dropper", "--towers", "2", *FAST)  # fmt: skip
    assert code == 1, out
    # Keras numbers layers per process (dense, dense_1, …): the second variable is a bias
    assert re.search(r"FIRST DIVERGENCE: step 3, variable dense(_\d+)?/bias \(#1, gradient; "
                     r"reduction \(tests\.cli\.test_bisect:make_dropper\)\)", out), out
    assert "step 4" not in out  # it stops at the first step outside the bound


def test_invariance_flags_the_dropped_tower_and_exits_1(capsys) -> None:
    code, out, _ = _run(capsys, "invariance", "--towers", "1,2", "--algorithm",
                        "tests.cli.test_bisect:make_dropper", *FAST)  # fmt: skip
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
