"""One grammar for every command: ``module:NAME`` for algorithms and codecs, and usage errors
that are one line, exit 2, name the option and come before any work.

"Before any work" is checked by replacing the command's ``run`` with one that fails the
test: a usage error must stop in the parser. The user's algorithm lives in a file written
to a temporary folder (the current directory of the test), as a user's ``my_algos.py``;
its registry record is removed afterwards so no other test sees it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from towers import cli
from towers.allreduce import ALGORITHMS

MY_ALGOS = '''\
import tensorflow as tf

from towers.allreduce import Algorithm, check_values, combine, finish, register, send


def star_d(values, *, op="sum"):
    devices = check_values(values, op)
    hub = devices[-1]
    with tf.device(hub):
        total = send(values[0], hub)
        for v in values[1:]:
            total = combine(total, send(v, hub), op)
        total = finish(total, op, len(values))
    return [send(total, d) for d in devices]


register(Algorithm(
    "star_d", lambda: star_d,
    bytes_sent=lambda n, nbytes, itemsize: [nbytes] * (n - 1) + [(n - 1) * nbytes],
    summation_depth=lambda n: n - 1,
))
'''


@pytest.fixture
def my_algos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "my_algos.py").write_text(MY_ALGOS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_algos", raising=False)
    yield tmp_path
    ALGORITHMS.pop("star_d", None)


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
    (["bench", "--out", "my_algos.py"], "argument --out: 'my_algos.py' is a file"),
    (["timeline", "--out", "missing/t.json"], "argument --out: cannot write 'missing/t.json'"),
    (["timeline", "--algorithm", "my_algos:nothing"], "argument --algorithm: module "
     "'my_algos' has no 'nothing'"),
    (["trace", "--json", "/proc/t.json"], "argument --json: cannot write '/proc/t.json'"),
    (["train", "--codec", "zip"], "argument --codec: unknown codec 'zip'; registered: bf16"),
    (["train", "--algorithm", "butterfly"], "argument --algorithm: unknown algorithm"),
], ids=["check-ops", "check-dtypes", "check-name", "check-module", "bench-module",
        "bench-name", "bench-section", "bench-model", "bench-out-file", "timeline-out",
        "timeline-attr", "trace-json", "train-codec", "train-algorithm"])
def test_a_usage_error_is_one_line_naming_the_option_before_any_work(
    argv: list[str], blame: str, my_algos: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = _usage_error(argv, capsys, monkeypatch)
    assert err.count("\n") == 1 and err.startswith(f"towers {argv[0]}: error: "), err
    assert blame in err, err


def test_every_command_parses_module_names(my_algos: Path) -> None:
    parse = cli.parser().parse_args
    assert parse(["check", "my_algos:star_d"]).algorithm == "my_algos:star_d"
    assert parse(["bench", "--algorithms", "ring,my_algos:star_d,tf.CollectiveAllReduce"]
                 ).algorithms == ["ring", "my_algos:star_d", "tf.CollectiveAllReduce"]
    assert parse(["timeline", "--algorithm", "my_algos.py:star_d"]).algorithm == \
        "my_algos.py:star_d"
    args = parse(["train", "--algorithm", "my_algos:star_d", "--codec", "towers.allreduce:fp16"])
    assert (args.algorithm, args.codec) == ("my_algos:star_d", "towers.allreduce:fp16")


def test_check_finds_the_registry_record_of_a_module_function(
    my_algos: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["check", "my_algos:star_d", "--towers", "3", "--examples", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no registry record" not in out and "bytes not checked" not in out, out


def test_bench_times_a_module_algorithm(my_algos: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    code = cli.main(["bench", "--sections", "allreduce", "--algorithms", "my_algos:star_d",
                     "--towers", "2", "--sizes", "4096", "--rounds", "1", "--no-plots",
                     "--quiet", "--out", str(my_algos / "bench")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "star_d" in out and (my_algos / "bench" / "allreduce.csv").is_file(), out
