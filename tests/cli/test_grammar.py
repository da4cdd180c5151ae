"""One grammar for every command: ``module:NAME`` for algorithms and codecs, and usage errors
that are one line, exit 2, name the option and come before any work.

"Before any work" is checked by replacing the command's ``run`` with one that fails the
test: a usage error must stop in the parser. The user's algorithms are conftest's
``user_module``: a ``user_star.py`` in the test's current folder, with a registered
``star_d``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from towers import cli


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> str:
    module = importlib.import_module(cli.COMMANDS[argv[0]][0])

    def no_work(args: object) -> int:
        raise AssertionError(f"towers {argv[0]} started work despite a usage error")

    monkeypatch.setattr(module, "run", no_work)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "blame"), [
    (["check", "ring", "--ops", "prod"], "argument --ops: unknown op 'prod'; choose from sum"),
    (["check", "ring", "--dtypes", "float8"], "argument --dtypes: unknown dtype 'float8'"),
    (["check", "butterfly"], "argument algorithm: unknown algorithm 'butterfly'"),
    (["check", "no_such_module:fn"], "argument algorithm: cannot import 'no_such_module'"),
    (["bench", "--algorithms", "ring,no_such_module:x"],
     "argument --algorithms: cannot import 'no_such_module'"),
    (["bench", "--algorithms", "butterfly"], "argument --algorithms: unknown algorithm"),
    (["bench", "--sections", "allreduce,foo"], "argument --sections: unknown section 'foo'"),
    (["bench", "--models", "resnet"], "argument --models: unknown model 'resnet'"),
    (["bench", "--out", "user_star.py"], "argument --out: 'user_star.py' is a file"),
    (["timeline", "--out", "missing/t.json"], "argument --out: cannot write 'missing/t.json'"),
    (["timeline", "--algorithm", "user_star:nothing"], "argument --algorithm: module "
     "'user_star' has no 'nothing'"),
    (["trace", "--json", "/proc/t.json"], "argument --json: cannot write '/proc/t.json'"),
    (["train", "--codec", "zip"], "argument --codec: unknown codec 'zip'; registered: bf16"),
    (["train", "--algorithm", "butterfly"], "argument --algorithm: unknown algorithm"),
], ids=["check-ops", "check-dtypes", "check-name", "check-module", "bench-module",
        "bench-name", "bench-section", "bench-model", "bench-out-file", "timeline-out",
        "timeline-attr", "trace-json", "train-codec", "train-algorithm"])
def test_a_usage_error_is_one_line_naming_the_option_before_any_work(
    argv: list[str], blame: str, user_module: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = _usage_error(argv, capsys, monkeypatch)
    assert err.count("\n") == 1 and err.startswith(f"towers {argv[0]}: error: "), err
    assert blame in err, err


def test_every_command_parses_module_names(user_module: str) -> None:
    parse = cli.parsers()[0].parse_args
    assert parse(["check", "user_star:star_d"]).algorithm == "user_star:star_d"
    assert parse(["bench", "--algorithms", "ring,user_star:star_d,tf.CollectiveAllReduce"]
                 ).algorithms == ["ring", "user_star:star_d", "tf.CollectiveAllReduce"]
    assert parse(["timeline", "--algorithm", "user_star.py:star_d"]).algorithm == \
        "user_star.py:star_d"
    args = parse(["train", "--algorithm", "user_star:star_d", "--codec", "towers.allreduce:fp16"])
    assert (args.algorithm, args.codec) == ("user_star:star_d", "towers.allreduce:fp16")


def test_check_finds_the_registry_record_of_a_module_function(
    user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["check", "user_star:star_d", "--towers", "3", "--examples", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no registry record" not in out and "bytes not checked" not in out, out


def test_bench_times_a_module_algorithm(user_module: str, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    code = cli.main(["bench", "--sections", "allreduce", "--algorithms", "user_star:star_d",
                     "--towers", "2", "--sizes", "4096", "--rounds", "1", "--no-plots",
                     "--quiet", "--out", "bench"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "star_d" in out and Path("bench/allreduce.csv").is_file(), out
