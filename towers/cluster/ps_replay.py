"""The update log on disk, and its bitwise NumPy replay.

::

    version 0 = initial weights
    for u, record in enumerate(log.records):        # the order the ps applied them
        (SGD)       w ← w − g_u·lr
        (momentum)  m ← m·μ − g_u·lr ;  w ← w + m
        version u+1 = w                              # record.version == u + 1

Float32 elementwise NumPy arithmetic rounds exactly as TensorFlow's CPU kernels for
``Mul``, ``Sub``, ``AssignSubVariableOp`` and ``AssignAddVariableOp`` (one IEEE
operation each, no fused multiply-add), so the replay reproduces every version the
parameter servers held bit for bit. Supported: SGD, with or without (non-Nesterov)
momentum — the rules :class:`~towers.cluster.ps.ParameterStore` applies.

On disk: ``PREFIX.json`` (the records and the rule) and ``PREFIX.npz`` (``u{u}_v{i}``:
update u's gradient for variable i).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from towers.cluster.ps_train import UpdateLog, UpdateRecord

__all__ = ["load_log", "replay", "replay_versions", "save_log"]


def save_log(log: UpdateLog, prefix: str | Path) -> tuple[Path, Path]:
    """Write ``PREFIX.json`` and ``PREFIX.npz``; return both paths."""
    prefix = Path(prefix)
    meta = {"learning_rate": log.learning_rate, "momentum": log.momentum,
            "placement": log.placement,
            "records": [vars(r) for r in log.records]}
    json_path, npz_path = prefix.with_suffix(".json"), prefix.with_suffix(".npz")
    json_path.write_text(json.dumps(meta, indent=1))
    arrays = {f"u{u}_v{i}": g for u, grads in enumerate(log.gradients) for i, g in enumerate(grads)}
    np.savez(npz_path, **arrays)  # type: ignore[arg-type]
    return json_path, npz_path


def load_log(prefix: str | Path) -> UpdateLog:
    """Read a log written by :func:`save_log`.

    Raises:
        ValueError: the files disagree (a gradient missing).
    """
    prefix = Path(prefix)
    meta = json.loads(prefix.with_suffix(".json").read_text())
    records = [UpdateRecord(**r) for r in meta["records"]]
    n = len(meta["placement"])
    with np.load(prefix.with_suffix(".npz")) as data:
        missing = [f"u{u}_v{i}" for u in range(len(records)) for i in range(n)
                   if f"u{u}_v{i}" not in data.files]
        if missing:
            raise ValueError(f"log {prefix}: the .npz lacks gradients {missing[:5]}")
        gradients = [[data[f"u{u}_v{i}"] for i in range(n)] for u in range(len(records))]
    return UpdateLog(records, gradients, meta["learning_rate"], meta["momentum"],
                     meta["placement"])


def replay_versions(log: UpdateLog,
                    initial_weights: Sequence[np.ndarray]) -> Iterator[list[np.ndarray]]:
    """Yield the weights of version 0, 1, …, len(log.records), in NumPy float32.

    Raises:
        ValueError: the log is out of order (a record's version is not its position + 1)
            or its gradients do not match the weights' shapes.
    """
    lr, mu = np.float32(log.learning_rate), np.float32(log.momentum)
    weights = [np.array(w, np.float32) for w in initial_weights]
    moments = [np.zeros_like(w) for w in weights]
    yield [w.copy() for w in weights]
    for u, (record, grads) in enumerate(zip(log.records, log.gradients)):
        if record.version != u + 1:
            raise ValueError(f"log: update {u} has version {record.version}, expected {u + 1}")
        if [g.shape for g in grads] != [w.shape for w in weights]:
            raise ValueError(f"log: update {u}'s gradient shapes {[g.shape for g in grads]} "
                             f"do not match the weights' {[w.shape for w in weights]}")
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float32)
            if log.momentum:
                moments[i] = moments[i] * mu - g * lr
                weights[i] = weights[i] + moments[i]
            else:
                weights[i] = weights[i] - g * lr
        yield [w.copy() for w in weights]


def replay(log: UpdateLog, initial_weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The final weights: every logged gradient applied in logged order (see the module).

    Args:
        log: the update log (e.g. :func:`load_log`).
        initial_weights: version 0's weights (``AsyncTrainer.initial_weights()``).

    Returns:
        The weights after the last logged update.

    Example:
        >>> final = replay(load_log("run"), initial)                   # doctest: +SKIP
    """
    versions = replay_versions(log, initial_weights)
    last = next(versions)
    for last in versions:  # noqa: B007 - keep the newest version only
        pass
    return last
