"""``python -m towers train``, the README's quick start, run as a user runs it (own process).

One epoch with the README's defaults (4 towers, ``naive``, replicated), ~12 s on 2 cores.
What the README promises is checked on the printed result: the job learns, and with an
algorithm that adds in the reference's order the largest weight difference to
MirroredStrategy is printed as exactly ``0``. Bad options are checked in-process (the
parser and ``run``'s early check, before TensorFlow starts), plus one exit code end to end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIFF = re.compile(r"largest weight difference to MirroredStrategy \((\w+)\): (\S+) ")
ACCURACY = re.compile(r"^test accuracy: ([\d.]+)", re.MULTILINE)
REF_ACCURACY = re.compile(r"^reference test accuracy: ([\d.]+)", re.MULTILINE)


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = str(ROOT)  # TensorFlow's log level is the command's own
    return subprocess.run(
        [sys.executable, "-m", "towers", "train", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )


@pytest.mark.long
def test_quick_start_learns_and_matches_mirrored_bitwise() -> None:
    done = _train("--epochs", "1")
    out = done.stdout
    assert done.returncode == 0, out[-2000:] + done.stderr[-3000:]
    assert out.startswith("towers train: 4 towers"), out[:300]
    assert "all_reduce=naive, variables=replicated" in out
    assert out.count("towers epoch 1/1:") == 1 and "Epoch " not in out  # one epoch counter
    assert "cuInit" not in done.stderr and "rendezvous" not in done.stderr
    accuracy = float(ACCURACY.search(out).group(1))  # type: ignore[union-attr]
    # 10 classes: chance is 0.10. One epoch of Adam 3e-3 reaches 0.78 here (seeded, so
    # deterministic); 0.5 is far above chance and far below what one epoch learns.
    assert 0.5 < accuracy <= 1.0, out
    kind, diff = DIFF.search(out).groups()  # type: ignore[union-attr]
    assert kind == "reduction_to_one_device"  # the reference that adds in naive's order
    assert diff == "0", out  # same summation order: bitwise, as the README says
    # bitwise-equal weights predict the same test labels
    assert float(REF_ACCURACY.search(out).group(1)) == accuracy  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--towers", "0"), "--towers: must be an integer >= 1"),
        (("--epochs", "0"), "--epochs: must be an integer >= 1"),
        (("--batch-size", "x"), "--batch-size: expected an integer"),
        (("--variables", "sharded-ish"), "--variables: invalid choice"),
        (("--reference", "ring"), "--reference: invalid choice"),
        (("--algorithm", "butterfly"), "unknown algorithm 'butterfly'"),
        (("--algorithm", "tests.cli.test_train:ROOT"), "is a PosixPath, not an all-reduce"),
    ],
)
def test_bad_options_exit_non_zero_with_the_reason(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from towers.cli import main

    try:
        code = main(["train", *args])
    except SystemExit as exit_:  # argparse's usage error
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_bad_option_fails_the_process() -> None:
    done = _train("--epochs", "0")
    assert done.returncode == 2, done.stdout[-1000:] + done.stderr[-2000:]
    assert "--epochs: must be an integer >= 1" in done.stderr
    assert "Traceback" not in done.stderr and "towers train:" not in done.stdout


def test_an_algorithm_that_breaks_the_contract_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from towers.cli import main

    code = main(["train", "--algorithm", "tests.cli.test_check:forgets_the_last", "--epochs", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("towers train: error:") and "forgets_the_last" in err, err
    assert "\n" not in err and "Traceback" not in err


def test_verbose_shows_the_error_it_would_have_put_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from towers.cli import main

    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")  # --verbose sets it; restored after
    with pytest.raises(ValueError, match="forgets_the_last"):
        main(["train", "--algorithm", "tests.cli.test_check:forgets_the_last", "--epochs", "1",
              "--verbose"])
