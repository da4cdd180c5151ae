"""The XLA table's rows (timing XLA is a benchmark, never a test)."""

from towers.bench.xla import xla_table


def test_xla_table_shows_ratio_and_failures() -> None:
    rows = [{"model": "mlp", "config": "MirroredStrategy", "ms": 100.0, "ratio": 1.0,
             "error": None},
            {"model": "mlp", "config": "towers naive/replicated +XLA", "ms": 130.0,
             "ratio": 1.3, "error": None},
            {"model": "mlp", "config": "CentralStorageStrategy +XLA", "ms": None,
             "ratio": None, "error": "InvalidArgumentError: no kernel"}]
    lines = xla_table(rows).splitlines()
    assert lines[2].split()[-2:] == ["130.0", "1.30"]
    assert "failed: InvalidArgumentError" in lines[3]
