"""Peak memory of a training step, per configuration, each in a fresh process.

A process's peak resident set (``VmHWM``) only grows, so each configuration
runs alone in a child process (``python -m towers.bench.memory``): import
TensorFlow, simulate the devices, build the configuration, read the peak
(``built``), run a few steps, read it again (``peak``). ``step = peak − built`` is
what the steps added on top of the model, its copies and the optimizer's slots:
activations, gradients, reduction buffers. The wide MLP makes the weights
dominate (a copy per tower under ``replicated``, one under ``parameter_device``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from towers.bench import report
from towers.bench.report import format_table
from towers.bench.training import profile_steps
from towers.devices import simulate_devices
from towers.placement import optimizer_state_bytes
from towers.step import TowerTrainer
from towers.training.models import mlp

__all__ = [
    "CONFIGS", "measure", "memory_section", "memory_table", "optimizer_state", "run_memory",
]

CONFIGS = (
    "MirroredStrategy", "CentralStorageStrategy", "towers naive/parameter_device",
    "towers ring/replicated",
)
TIMEOUT_S = 300


def _peak_mib() -> float:
    """This process's peak RSS in MiB: ``VmHWM`` (Linux), else ``ru_maxrss``.

    ``ru_maxrss`` survives ``execve``: a child started by a big parent would report the
    parent's peak, so ``VmHWM`` (per address space, fresh after ``execve``) comes first.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(config: str, model: str, towers: int, batch: int, steps: int) -> dict[str, Any]:
    """In this process: build ``config`` and run ``steps`` steps; peak RSS in MiB."""
    devices = simulate_devices(towers)

    start = _peak_mib()
    [step] = profile_steps(model, devices, [config], batch=batch).values()
    built = _peak_mib()
    for _ in range(steps):
        step()
    peak = _peak_mib()
    return {"config": config, "model": model, "towers": towers, "batch": batch,
            "imported_mib": start, "built_mib": built, "peak_mib": peak,
            "step_mib": peak - built}


def run_memory(
    configs: Sequence[str] = CONFIGS, *, model: str = "mlp", towers: int = 4, batch: int = 256,
    steps: int = 3,
) -> list[dict[str, Any]]:
    """:func:`measure` each configuration in its own child process; one row each."""
    rows = []
    for config in configs:
        argv = [sys.executable, "-m", "towers.bench.memory", "--config", config,
                "--model", model, "--towers", str(towers), "--batch", str(batch),
                "--steps", str(steps)]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"config": config, "model": model, "towers": towers, "batch": batch,
                         "error": f"exit {done.returncode}: {tail}"[:200]})
        else:
            rows.append({**json.loads(lines[-1]), "error": ""})
    return rows


def memory_table(rows: Sequence[dict[str, Any]]) -> str:
    """MiB after import, after building, at the peak of the steps, and what the steps added."""
    def mib(key: str) -> Any:
        return lambda r: f"{r[key]:.0f}" if r.get(key) is not None else "-"

    return format_table([
        ("config\n", "l", lambda r: r["config"]),
        ("imported\n(MiB)", "r", mib("imported_mib")), ("built\n(MiB)", "r", mib("built_mib")),
        ("peak\n(MiB)", "r", mib("peak_mib")), ("step\n(MiB)", "r", mib("step_mib")),
        ("error\n", "l", lambda r: r.get("error", "")),
    ], list(rows))


def optimizer_state(devices: Sequence[str]) -> list[dict[str, Any]]:
    """Adam's state per tower on the wide MLP, ``replicated`` against ``sharded`` (exact
    bytes of every replica's ``optimizer.variables``; ZeRO's promise is 1/n)."""
    import keras


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


def memory_section(args: Any, devices: list[str], results: dict) -> bool:
    """``towers bench --sections memory``: peak RSS per configuration on the wide MLP."""
    print(f"\n== memory: peak RSS of mlp steps, {args.towers} towers, batch {args.batch_size}, "
          "one fresh process per configuration", flush=True)
    rows = run_memory(towers=args.towers, batch=args.batch_size)
    print(memory_table(rows))
    results["memory"] = rows
    state = optimizer_state(devices[: args.towers])
    print("\nAdam state per tower (wide MLP), bytes: " + "; ".join(
        f"{r['placement']} {r['max_bytes_per_tower']:,} ({r['ratio_to_replicated']:.3f})"
        for r in state))
    results["optimizer_state"] = state
    report.write_csv(args.out / "memory.csv", rows)
    return not any(r["error"] for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Child process entry point: print one JSON row."""
    parser = argparse.ArgumentParser(prog="python -m towers.bench.memory")
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    a = parser.parse_args(argv)
    print(json.dumps(measure(a.config, a.model, a.towers, a.batch, a.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
