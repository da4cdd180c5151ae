"""The kernel-noise floor: how far one step's gradient moves with the kernels alone.

The same step under every kernel configuration (oneDNN on/off in a subprocess each, tower
counts, Grappler's graph or ``as_written``); the floor is the largest difference in ULPs of
a variable's largest gradient element (docs/bounds.md §3). Two subprocesses, about 15 s of
CPU each:

    python tools/kernel_noise.py conv
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's towers
from towers.allreduce.machinery.base import as_written
from towers.devices import simulate_devices
from towers.guard.arguments import check_choice, positive_float, positive_int
from towers.step import TowerTrainer
from towers.testing.strategies import FAMILIES, ModelSpec, loss_fn

__all__ = ["NoiseReport", "kernel_noise_floor"]

ONEDNN = ("1", "0")
# batch statistics and per-tower dropout masks: another tower count is another computation,
# so these families are compared at equal tower counts only
SHARD_DEPENDENT = ("batchnorm", "dropout")
GRAPHS = ("default", "as_written")


@dataclasses.dataclass(frozen=True)
class NoiseReport:
    """The floor of one model family, in ULPs of a variable's largest gradient element;
    ``worst`` is ``(configuration, variable index)`` where it was met (None: all equal)."""

    family: str
    floor_ulps: float
    worst: tuple[str, int] | None
    ulps: dict[str, float]


def kernel_noise_floor(
    family: str, *, towers: Sequence[int] = (1, 2, 4), onednn: Sequence[str] = ONEDNN,
    graphs: Sequence[str] = GRAPHS, batch: int = 16, seed: int = 0, timeout: float = 300.0,
) -> NoiseReport:
    """Run one step's forward/backward under every kernel configuration; report the floor.

    ``family``: one of :data:`~towers.testing.strategies.FAMILIES`; ``onednn``: values of
    ``TF_ENABLE_ONEDNN_OPTS``, one subprocess each (``timeout`` seconds); ``graphs``:
    ``"default"`` and/or ``"as_written"``. RuntimeError: a subprocess failed or timed out.
    """
    check_choice("family", family, FAMILIES)
    counts = [positive_int("towers", n) for n in towers]
    if not counts or max(counts) > positive_int("batch", batch):
        raise ValueError(f"towers must be non-empty counts <= batch ({batch}), got {towers}")
    for value in onednn:
        check_choice("onednn", value, ONEDNN)
    for graph in graphs:
        check_choice("graphs", graph, GRAPHS)
    positive_float("timeout", timeout)
    grads: dict[str, list[np.ndarray]] = {}
    for flag in onednn:
        grads.update(_run_worker(family, flag, counts, list(graphs), batch, seed, timeout))
    return _compare(family, grads)


def _run_worker(family: str, flag: str, counts: list[int], graphs: list[str], batch: int,
                seed: int, timeout: float) -> dict[str, list[np.ndarray]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads.npz")
        spec = json.dumps({"family": family, "towers": counts, "graphs": graphs,
                           "batch": batch, "seed": seed, "out": out})  # fmt: skip
        env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": flag, "TF_CPP_MIN_LOG_LEVEL": "2"}
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--worker", spec], env=env,
                capture_output=True, text=True, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"kernel_noise_floor: the oneDNN={flag} run passed "
                               f"timeout={timeout:g} s") from None  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"kernel_noise_floor: the oneDNN={flag} run failed:\n"
                               f"{done.stderr[-2000:]}")  # fmt: skip
        with np.load(out) as data:
            labels = {name.rsplit("/", 1)[0] for name in data.files}
            return {f"onednn={flag},{label}": [data[f"{label}/{j}"] for j in
                    range(sum(1 for n in data.files if n.startswith(label + "/")))]
                    for label in sorted(labels)}  # fmt: skip


def _compare(family: str, grads: dict[str, list[np.ndarray]]) -> NoiseReport:
    """Each configuration against the first of all (or of its tower count, for
    :data:`SHARD_DEPENDENT` families)."""
    ulps: dict[str, float] = {}
    worst: tuple[str, int] | None = None
    floor = 0.0
    references: dict[str, str] = {}
    for label in grads:
        group = label.split(",")[1] if family in SHARD_DEPENDENT else ""
        reference = grads[references.setdefault(group, label)]
        if references[group] == label:
            continue
        per_var = [float(np.max(np.abs(g - r), initial=0.0)
                         / np.spacing(np.float32(np.max(np.abs(r), initial=0.0))))
                   for g, r in zip(grads[label], reference)]  # fmt: skip
        ulps[label] = max(per_var, default=0.0)
        if ulps[label] > floor:
            floor, worst = ulps[label], (label, int(np.argmax(per_var)))
    return NoiseReport(family, floor, worst, ulps)


def _worker(spec: dict[str, Any]) -> None:
    """The subprocess of one oneDNN setting: every tower count × graph, saved."""
    devices = simulate_devices(max(spec["towers"]), kind="cpu")
    model_spec = ModelSpec(spec["family"], seed=spec["seed"])
    x, y = model_spec.batch(spec["batch"], seed=spec["seed"])
    arrays = {}
    for n, graph in itertools.product(spec["towers"], spec["graphs"]):
        trainer = TowerTrainer(model_spec.build, keras.optimizers.SGD(0.1), loss_fn(),
                                       devices=devices[:n], all_reduce="naive")  # fmt: skip
        phase = tf.function(lambda a, b, t=trainer: t.forward_backward(t.split(a, b)),
                            autograph=False)  # fmt: skip
        with as_written() if graph == "as_written" else contextlib.nullcontext():
            result = phase(tf.constant(x), tf.constant(y))
        for j in range(len(trainer.model.trainable_variables)):
            towers_j = [np.asarray(tf.convert_to_tensor(r.grads[j]), np.float64)
                        for r in result.towers]  # fmt: skip
            arrays[f"towers={n},graph={graph}/{j}"] = np.sum(towers_j, axis=0)
    np.savez(spec["out"], **arrays)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
    else:
        print(kernel_noise_floor(sys.argv[1]))
