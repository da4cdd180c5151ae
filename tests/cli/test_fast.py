"""A command line that answers at once: usage errors before TensorFlow, quiet logs, output
only where asked, the counts announced are the counts run, every default in ``--help``.

"At once" is checked by what was imported, never by a stopwatch: every usage error below
runs in one fresh interpreter, and after each ``tensorflow`` and ``keras`` must still be
absent from ``sys.modules`` (importing them is what took 8-15 s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from towers import cli
from towers.cli import arguments
from towers.cli.check import budgets

ROOT = Path(__file__).resolve().parents[2]

USAGE_ERRORS = [
    (["train", "--epochz", "2"],
     "unrecognized arguments: --epochz 2 (did you mean '--epochs'?)"),
    (["trace", "--algorithm", "rign"], "argument --algorithm: unknown algorithm 'rign' "
     "(did you mean 'ring'?); choose from bruck"),
    (["check", "nosuchfile.py:f"], "argument algorithm: no such file 'nosuchfile.py'"),
    (["check", "no_such_module_xyz:f"], "argument algorithm: cannot import 'no_such_module_xyz'"),
    (["check", "ring", "--ops", "prod"],
     "argument --ops: unknown op 'prod'; choose from sum, mean, max, min"),
    (["check", "ring", "--ops", "maximum"], "unknown op 'maximum' (did you mean 'max'?)"),
    (["check", "ring", "--towers", "2,9"], "argument --towers: 9 is more than --max-towers 8"),
    (["train", "--variables", "paramter_device"],
     "argument --variables: invalid choice: 'paramter_device'"),
    (["trace", "ring", "--algorithm", "tree"], "disagree: give one"),
    (["trace", "ring", "--html", "/no/such/dir/r.html"], "argument --html: cannot write"),
    (["timeline", "--towers", "8", "--batch-size", "4"], "argument --batch-size: 4 leaves"),
    (["compare", "--a", "rign", "--b", "mirrored"], "argument --a: unknown algorithm 'rign' "
     "(did you mean 'ring'?)"),
    (["bisect", "--a", "towers:rign", "--b", "ring"], "(did you mean 'ring'?)"),
    (["compare", "--a", "ring", "--b", "mirrored", "--model", "no_such_module_xyz:m"],
     "argument --model: cannot import 'no_such_module_xyz'"),
    (["invariance", "--step", "no_such_module_xyz:f"],
     "argument --step: cannot import 'no_such_module_xyz'"),
    (["launch", "--workers", "0", "--", "true"], "argument --workers: must be an integer >= 1"),
    (["study", "--out", "/no/such/dir/s"], "--out: cannot write '/no/such/dir/s.png': no folder"),
    (["study", "ring", "fp61"], "argument REDUCER: 'fp61': unknown 'fp61' (did you mean 'fp16'?)"),
    (["study", "topk(0.1)@rign"], "unknown all-reduce 'rign' after @ (did you mean 'ring'?)"),
]

RUN_EACH = """
import contextlib, io, json, sys
from towers.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras"))
    results.append((code, err.getvalue(), heavy[:3]))
print(json.dumps(results))
"""


def test_every_usage_error_is_one_line_exit_2_before_tensorflow(tmp_path: Path) -> None:
    argvs = [argv for argv, _ in USAGE_ERRORS]
    proc = subprocess.run([sys.executable, "-c", RUN_EACH, json.dumps(argvs)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (argv, blame), (code, err, heavy) in zip(USAGE_ERRORS, json.loads(proc.stdout)):
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and err.startswith(f"towers {argv[0]}: error: "), (argv, err)
        assert blame in err, (argv, err)
        assert not heavy, f"towers {' '.join(argv)} imported {heavy} before its usage error"


def test_the_names_checked_without_tensorflow_are_the_registries() -> None:
    import towers
    from towers.allreduce import CODECS
    from towers.allreduce.machinery.base import DTYPES, OPS
    from towers.testing.compare import REFERENCES

    assert tuple(sorted(towers.ALGORITHMS)) == arguments.ALGORITHMS
    assert tuple(sorted(CODECS)) == arguments.CODECS
    from towers.allreduce import COLLECTIVE_ALGORITHMS

    assert tuple(sorted({name for _, name in COLLECTIVE_ALGORITHMS})) == arguments.COLLECTIVES
    assert tuple(OPS) == arguments.OPS
    assert tuple(d.name for d in DTYPES) == arguments.DTYPES
    assert tuple(REFERENCES) == arguments.REFERENCES
    from towers.bench.training import MODELS
    from towers.step import PLACEMENTS

    assert tuple(MODELS) == arguments.MODELS and tuple(PLACEMENTS) == arguments.PLACEMENTS


def _help_entries(text: str) -> dict[str, str]:
    """Each option's help text in ``--help`` output, by its first option string."""
    entries: dict[str, str] = {}
    option = None
    for line in text.split("options:", 1)[1].split("\n\n", 1)[0].splitlines():
        match = re.match(r"^  (-[-\w]+)", line)
        if match:
            option = match[1]
            entries[option] = line
        elif option:
            entries[option] += " " + line.strip()
    return entries


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_shows_every_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    entries = _help_entries(capsys.readouterr().out)
    parser = cli.parsers()[1][command]
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, "==SUPPRESS=="):
            assert "default" in entries[action.option_strings[0]], entries[
                action.option_strings[0]]


def _trace(*args: str, verbose: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, "-m", "towers", "trace", "ring", "--towers", "2", "--no-png", *args,
         *(["--verbose"] if verbose else [])],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


@pytest.mark.long
def test_tensorflow_logs_only_with_verbose() -> None:
    quiet = _trace()
    assert quiet.returncode == 0 and "result vs NumPy: OK" in quiet.stdout, quiet.stderr
    assert quiet.stderr == "", quiet.stderr  # no cuInit, no absl preamble, nothing
    loud = _trace(verbose=True)
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert re.search(r"^[IWE]\d{4} ", loud.stderr, re.MULTILINE), loud.stderr[-2000:]


def test_trace_writes_only_what_was_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["trace", "ring", "--n", "4", "--html", "ring.html"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ring.html"]
    assert cli.main(["trace", "ring", "--n", "2"]) == 0  # no output named: the picture
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ring.html", "ring.png"]
    capsys.readouterr()


def test_the_examples_spread_adds_up() -> None:
    assert budgets(20, 8) == [3, 3, 3, 3, 2, 2, 2, 2]
    assert budgets(7, 3) == [3, 2, 2]
    assert budgets(3, 4) == [2, 2, 2, 2]  # at least 2 per tower count


def test_check_announces_the_examples_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["check", "ring", "--towers", "1,2,3", "--examples", "7"])
    out = capsys.readouterr().out
    assert code == 0, out
    announced = re.search(r"(\d+) drawn examples", out)
    run = re.search(r"PASS: ring \((\d+) examples run\)", out)
    assert announced and run, out
    assert announced[1] == run[1] == "7", out
