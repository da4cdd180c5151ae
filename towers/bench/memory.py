"""Peak memory (``VmHWM``) of a training step, per configuration, each in a fresh process.

A peak only grows: each configuration runs alone in a child process (:func:`measure`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import keras

from towers.bench import report
from towers.bench.training import build_steps
from towers.devices import simulate_devices
from towers.placement import optimizer_state_bytes
from towers.step import TowerTrainer
from towers.training.models import mlp

__all__ = ["CONFIGS", "measure", "optimizer_state", "run_memory", "section", "table"]

CONFIGS = ("MirroredStrategy", "CentralStorageStrategy", "towers naive/parameter_device",
           "towers ring/replicated")


def _peak_mib() -> float:
    """This process's peak RSS in MiB: Linux's ``VmHWM`` (fresh after ``execve``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def measure(config: str, model: str, towers: int, batch: int, steps: int) -> dict[str, Any]:
    """In this process: build ``config`` and run ``steps`` steps; peak RSS in MiB."""
    devices = simulate_devices(towers)
    start = _peak_mib()
    [step] = build_steps(model, devices, [config], batch)[0].values()
    built = _peak_mib()
    for _ in range(steps):
        step()
    peak = _peak_mib()
    return {"config": config, "model": model, "towers": towers, "batch": batch,
            "imported_mib": start, "built_mib": built, "peak_mib": peak, "step_mib": peak - built}


def run_memory(configs: Sequence[str] = CONFIGS, *, model: str = "mlp", towers: int = 4,
               batch: int = 256, steps: int = 3) -> list[dict[str, Any]]:
    """:func:`measure` each configuration in its own child process; one row each."""
    rows = []
    for config in configs:
        call = f"measure{(config, model, towers, batch, steps)!r}"
        code = f"import json; from towers.bench.memory import measure; print(json.dumps({call}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"config": config, "model": model, "towers": towers, "batch": batch,
                         "error": f"exit {done.returncode}: {tail}"[:200]})
        else:
            rows.append({**json.loads(lines[-1]), "error": ""})
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """MiB after import, after building, at the peak of the steps, and what the steps added."""
    return report.format_table([
        ("config\n", "l", report.text("config")),
        ("imported\n(MiB)", "r", report.num("imported_mib", ".0f")),
        ("built\n(MiB)", "r", report.num("built_mib", ".0f")),
        ("peak\n(MiB)", "r", report.num("peak_mib", ".0f")),
        ("step\n(MiB)", "r", report.num("step_mib", ".0f")),
        ("error\n", "l", report.text("error")),
    ], rows)


def optimizer_state(devices: Sequence[str]) -> list[dict[str, Any]]:
    """Adam's state bytes per tower on the wide MLP, ``replicated`` against ``sharded``."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows: list[dict[str, Any]] = []
    for variables in ("replicated", "sharded"):
        trainer = TowerTrainer(mlp, keras.optimizers.Adam(), loss, devices=list(devices),
                               all_reduce="ring", variables=variables)
        per_tower = optimizer_state_bytes(trainer)
        rows.append({"placement": variables, "towers": len(devices),
                     "max_bytes_per_tower": max(per_tower), "total_bytes": sum(per_tower)})
    for row in rows:
        row["ratio_to_replicated"] = row["max_bytes_per_tower"] / rows[0]["max_bytes_per_tower"]
    return rows


def section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """``--sections memory``: peak RSS per configuration on the wide MLP, Adam's state."""
    report.heading(f"memory: peak RSS of mlp steps, {args.towers} towers, batch "
                   f"{args.batch_size}, one fresh process per configuration")
    rows = run_memory(towers=args.towers, batch=args.batch_size)
    report.publish(args, results, "memory", rows, table(rows))
    results["optimizer_state"] = state = optimizer_state(devices[: args.towers])
    print("\nAdam state per tower (wide MLP), bytes: " + "; ".join(
        f"{r['placement']} {r['max_bytes_per_tower']:,} ({r['ratio_to_replicated']:.3f})"
        for r in state))
    return not any(r["error"] for r in rows)

