"""towers trace: the tick table, bytes, ownership, the PNG, the JSON, user algorithms, errors.

The command itself needs a fresh device count, so it runs once as a subprocess
(ring, 4 towers); everything else runs in-process on ``DEVICES`` (8 logical CPUs
from conftest), with ``--towers 8`` when going through the command line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import tensorflow as tf

from tests.conftest import DEVICES
from towers import cli
from towers.allreduce import ALGORITHMS, Algorithm, check_values, combine, finish, send
from towers.allreduce.machinery.primitives import Transfer
from towers.allreduce.machinery.resolve import get, label
from towers.trace import (
    COLLECTIVE,
    draw,
    format_summary,
    format_table,
    to_json,
    trace_all_reduce,
)

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\s*(\d+)?\*?\s+tower (\d+)\s+-> tower (\d+)\s+(\S+)\s+~?(\d+)\s+(.*)$")

def transfers_from_json(data: dict) -> list[Transfer]:
    """The recorded transfers back from ``to_json``'s dict."""
    return [Transfer(**t) for t in data["transfers"]]


def _png(path: Path) -> None:
    assert path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _rows(stdout: str) -> list[tuple[int, int, int, str, int]]:
    """Parse the tick table: (tick, src, dst, chunk, bytes); a blank tick repeats the last."""
    rows, tick = [], -1
    for line in stdout.splitlines():
        match = ROW.match(line)
        if match:
            tick = int(match[1]) if match[1] is not None else tick
            rows.append((tick, int(match[2]), int(match[3]), match[4], int(match[5])))
    return rows


# -- the command, once, in a fresh process -----------------------------------------------------


@pytest.mark.long
def test_ring_command_prints_the_table_draws_and_writes_json(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    cmd = [sys.executable, "-m", "towers", "trace", "--algorithm", "ring", "--towers", "4",
           "--size", "16", "--out", "ring.png", "--json", "ring.json"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    n, nbytes = 4, 16 * 4
    rows = _rows(done.stdout)
    assert len(rows) == 2 * (n - 1) * n  # every tower sends once per tick
    assert sorted({r[0] for r in rows}) == list(range(2 * (n - 1)))
    for tick in range(2 * (n - 1)):
        assert sorted(r[1] for r in rows if r[0] == tick) == list(range(n))
    assert all(r[2] == (r[1] + 1) % n and r[4] == nbytes // n for r in rows)
    per_tower = 2 * (n - 1) * nbytes // n
    assert f"bytes sent: {' · '.join(f'tower {i} {per_tower}' for i in range(n))}" in done.stdout
    assert "result vs NumPy: OK" in done.stdout
    _png(tmp_path / "ring.png")
    data = json.loads((tmp_path / "ring.json").read_text())
    assert data["ticks"] == 2 * (n - 1) and data["result"]["ok"]
    # Same devices names in this process: the transfers are the same, and come back whole.
    expected = trace_all_reduce("ring", DEVICES[:n], size=16)
    assert transfers_from_json(data) == list(expected.transfers)


# -- the logic, in-process ----------------------------------------------------------------------


def test_ring_rows_bytes_and_ownership() -> None:
    n = 4
    trace = trace_all_reduce("ring", DEVICES[:n], size=16)
    assert trace.ticks == 2 * (n - 1) and len(trace.rows) == 2 * (n - 1) * n
    assert trace.bytes_sent() == [2 * (n - 1) * 64 // n] * n == list(trace.formula or ())
    assert not any(r.assigned or r.estimated for r in trace.rows)
    # Chunk k is finished on tower k at the last reduce-scatter tick, then copied everywhere.
    assert trace.finished == {k: (k, n - 2) for k in range(n)}
    assert all(held == set(range(n)) for held in trace.holds)
    assert trace.ok and trace.max_abs_error == 0 and trace.identical and trace.early == 0
    assert "   5  tower 0   -> tower 1" in format_table(trace)
    assert "chunks finished: c0 on tower 0 (tick 2)" in format_summary(trace)


def test_json_round_trips() -> None:
    trace = trace_all_reduce("tree", DEVICES[:5], size=10, op="max")
    data = json.loads(json.dumps(to_json(trace)))
    assert transfers_from_json(data) == list(trace.transfers)
    assert [tuple(r.values()) for r in data["rows"]] == [
        (r.tick, r.src, r.dst, r.chunk, r.nbytes, r.note, r.estimated, r.assigned, r.ready)
        for r in trace.rows
    ]
    assert data["bytes_sent"] == dict(zip(trace.places, trace.bytes_sent()))


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_traces_and_draws(name: str, tmp_path: Path) -> None:
    trace = trace_all_reduce(name, DEVICES[:4], size=12, op="mean")
    assert trace.ok, format_summary(trace)
    assert trace.rows, "a 4-tower all-reduce moves data"
    if trace.formula is not None:
        assert list(trace.formula) == trace.bytes_sent()[:4]
    if all(r.estimated for r in trace.rows):  # opaque collectives: marked, no ownership claimed
        assert trace.holds == () and "(estimated)" in format_table(trace)
    else:
        assert all(len(held) == len(trace.chunks) for held in trace.holds[:4])
    _png(draw(trace, tmp_path / f"{name}.png"))


def _chained(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A chain 0 → 1 → 2 whose ticks all claim 0: the second send carries the first's data."""
    devices = check_values(values, op)
    total = values[0]
    for i in range(1, len(values)):
        with tf.device(devices[i]):
            total = combine(send(total, devices[i], tick=0, chunk=0), values[i], op)
    total = finish(total, op, len(values))
    return [send(total, d, tick=1, chunk=0) for d in devices]


def test_ticks_by_order_and_early_transfers() -> None:
    trace = trace_all_reduce(_chained, DEVICES[:3], size=4)
    assert trace.ok and trace.early == 1 and "leave no later than" in format_summary(trace)
    again = trace_all_reduce(_chained, DEVICES[:3], size=4, by_order=True)
    assert [r.tick for r in again.rows] == [0, 1, 2, 3] and again.early == 0
    assert all(r.assigned for r in again.rows) and again.finished == {0: (2, 1)}


def _exchange(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Recursive doubling: in tick k towers i and i ^ 2^k swap their whole buffers."""
    devices = check_values(values, op)
    values, k = list(values), 0
    while 1 << k < len(values):
        new = []
        for i, device in enumerate(devices):
            with tf.device(device):
                got = send(values[i ^ 1 << k], device, tick=k, chunk=0)
                pair = (values[i], got) if i < i ^ 1 << k else (got, values[i])
                new.append(combine(*pair, op))
        values, k = new, k + 1
    return [finish(v, op, len(values)) for v in values]


def test_a_full_buffer_exchange_sends_its_own_data_not_what_it_receives() -> None:
    """Both towers of a pair send chunk 0 in one tick: the labels match, the data does not."""
    trace = trace_all_reduce(_exchange, DEVICES[:4], size=4)
    assert trace.ok and trace.ticks == 2
    assert trace.early == 0 and "leave no later than" not in format_summary(trace)
    assert [r.ready for r in trace.rows] == [-1] * 4 + [0] * 4
    again = trace_all_reduce(_exchange, DEVICES[:4], size=4, by_order=True)
    assert [r.tick for r in again.rows] == [r.tick for r in trace.rows]


def test_user_algorithm_by_module_path_without_ticks(user_module: str, tmp_path: Path,
                                                     capsys) -> None:
    png = tmp_path / "star.png"
    code = cli.main(["trace", "--algorithm", f"{user_module}:make_star", "--towers", "8",
                     "--out", str(png)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = _rows(out)
    # No ticks given: assigned by order, one receive per tick at the hub, then one send.
    assert [r[0] for r in rows] == list(range(14)) and "* tick assigned by order" in out
    assert {r[2] for r in rows[:7]} == {7} and {r[1] for r in rows[7:]} == {7}
    _png(png)
    spec = f"{tmp_path / 'user_star.py'}:star"
    name, fn = label(spec), get(spec, devices=DEVICES[:2])
    assert fn.__name__ == "star" and name.endswith(":star")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("butterfly", r"unknown algorithm 'butterfly'; choose from .*ring.*module:NAME"),
        ("no_such_module_xyz:fn", r"cannot import 'no_such_module_xyz'"),
        ("towers.allreduce.ring:nope", r"has no 'nope'; its callables: .*ring"),
        ("towers.allreduce.ring:__doc__", r"is a str, not an all-reduce"),
    ],
)
def test_unknown_algorithms_are_clear_errors(spec: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:  # a usage error, found while parsing
        cli.main(["trace", "--algorithm", spec, "--towers", "8", "--no-png"])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_silent_opaque_collective_is_estimated(tmp_path: Path) -> None:
    def opaque(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        devices = check_values(values, op)
        total = tf.add_n([tf.identity(v) for v in values])  # data moves outside send
        outs = []
        for d in devices:
            with tf.device(d):
                outs.append(tf.identity(total))
        return outs

    estimate = Algorithm(  # its record says: opaque, bytes an estimate
        "opaque", lambda: opaque, estimated=True, replayable=False,
        bytes_sent=lambda n, nbytes, itemsize: [2 * (n - 1) / n * nbytes] * n,
    )
    trace = trace_all_reduce(estimate(), DEVICES[:4], size=8)
    assert trace.ok and len(trace.rows) == 4 and all(r.estimated for r in trace.rows)
    assert trace.places[4] == COLLECTIVE and trace.holds == ()
    assert "not observable" in format_summary(trace)
    _png(draw(trace, tmp_path / "opaque.png"))


def test_one_tower_moves_nothing(tmp_path: Path) -> None:
    trace = trace_all_reduce("ring", DEVICES[:1], size=3)
    assert trace.ok and trace.rows == () and trace.ticks == 0
    assert "(no transfers)" in format_table(trace)
    _png(draw(trace, tmp_path / "one.png"))


def test_bad_options_are_refused_and_help_is_complete(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["trace", "--towers", "0"])
    assert exit_.value.code == 2
    with pytest.raises(ValueError, match="op must be one of"):
        trace_all_reduce("ring", DEVICES[:2], op="prod")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["trace", "--help"])
    text = capsys.readouterr().out
    for option in ("--algorithm", "--towers", "--size", "--op", "--out", "--json", "--ticks"):
        assert option in text
    assert "examples:" in text and "module:function" in text
