"""towers study on the command line: one tiny run in-process, and usage errors before any work."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from towers import cli


def test_a_tiny_study_writes_csv_png_and_the_table(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s"
    code = cli.main(["study", "ring", "fp16", "--towers", "2", "--model", "mlp", "--steps", "3",
                     "--eval-every", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    with open(f"{out}.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["reducer"] for r in rows] == ["ring"] * 3 + ["fp16"] * 3
    assert [bool(r["test_accuracy"]) for r in rows] == [True, False, True] * 2  # every 2nd
    assert Path(f"{out}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "gradient bytes" in printed and "1024xH100" in printed


class NotAnAlgorithm:
    """A factory of something that is neither an all-reduce nor a codec."""


@pytest.mark.parametrize("argv, message", [
    (["study", "zip"], "unknown 'zip'; choose an all-reduce"),
    (["study", "ring", "--out", "/no/such/folder/s"], "--out: cannot write '/no/such/folder/s"),
    (["study", "ring", "--batch", "100000"], "--batch 100000 is more than"),
    (["study", "ring", "--towers", "1"], "must be an integer >= 2"),
    (["study", "ring", "tests.cli.test_study:NotAnAlgorithm"], "made a NotAnAlgorithm: not"),
    (["study", "ring", "tests.cli.test_study:__doc__"], "is a str, not an all-reduce"),
], ids=["codec", "out", "batch", "towers", "class", "not_callable"])
def test_usage_errors_exit_2_with_one_line(argv: list[str], message: str, capsys) -> None:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's usage error: the usage, then one error line
        code = int(exit_.code or 0)
    err = capsys.readouterr().err.strip()
    assert code == 2
    last = err.splitlines()[-1]
    assert last.startswith("towers study: error: ") and message in last
    assert "Traceback" not in err
