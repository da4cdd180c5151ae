"""``python -m towers bench``: towers beside tf.distribute, all-reduce and training step.

On simulated devices: the all-reduce table and the cost model fitted to it, the
training-step table, the per-phase profile, peak memory and the cost model at 8 and 1024
H100s (``--workers W``: the cross-process all-reduce instead). Results go to ``--out``:
``bench.json`` (with the environment and load) and each section's CSV and PNG files.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from towers.cli.arguments import MODELS, PLACEMENTS, algorithms, at_least, choices, output_dir

__all__ = ["EPILOG", "SECTIONS", "add_arguments", "fresh_folder", "run"]

SECTIONS = ("allreduce", "costmodel", "training", "phases", "memory")
TF_CONTENDERS = ("tf.CollectiveAllReduce", "tf.ReductionToOneDevice")  # all-reduce table only

EPILOG = """examples:
  python -m towers bench --quick                     # 4 KB-1 MB, few rounds (~2 min)
  python -m towers bench --quick --out results       # write into ./results/
  python -m towers bench                             # 4 KB-64 MB, both models (~6 min)
  python -m towers bench --sections allreduce --algorithms naive,ring,tf.CollectiveAllReduce
  python -m towers bench --sections training,phases --models mlp
  python -m towers bench --sections allreduce --algorithms ring,my_algos:star   # ./my_algos.py
"""


def _ints(text: str) -> list[int]:
    values = [at_least(1)(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--towers", type=at_least(1), default=4, help="simulated devices for the tables")
    add("--quick", action="store_true", help="4 KB-1 MB, fewer rounds")
    add("--out", type=output_dir, default=None,
        help="output folder (default: a new ./towers-bench-<date>-<time>/)")
    add("--sections", type=choices(SECTIONS, "section"), default=list(SECTIONS),
        help=f"comma list of {', '.join(SECTIONS)} (default all)")
    add("--algorithms", type=algorithms(TF_CONTENDERS), default=None,
        help="comma list of registered algorithms or module:NAME (default all; tf.* names select "
        "tf.CollectiveAllReduce / tf.ReductionToOneDevice in the all-reduce table)")
    add("--sizes", type=_ints, default=None, help="comma list of bytes per tower")
    add("--rounds", type=at_least(1), default=None, help="all-reduce rounds (default 15; quick 9)")
    add("--step-rounds", type=at_least(1), default=None,
        help="training rounds (default 13; quick 5)")
    add("--models", type=choices(MODELS, "model"), default=None,
        help=f"comma list of {', '.join(MODELS)} (default all)")
    add("--batch-size", type=at_least(1), default=256, help="global batch of the step table (256)")
    add("--placements", type=choices(PLACEMENTS, "placement"), default=None,
        help=f"comma list of {', '.join(PLACEMENTS)} (default all)")
    add("--no-plots", action="store_true", help="skip the PNG plots")
    add("--quiet", action="store_true", help="no progress bars")
    add("--workers", type=at_least(2), default=None, help="instead: cross-process all-reduce "
        "of W worker processes, towers vs MWMS (towers.bench.workers; --sizes in MB)")


def environment(devices: list[str]) -> dict[str, Any]:
    """What the numbers depend on: versions, cores, threads, devices, load, time."""
    import keras
    import numpy as np
    import tensorflow as tf

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv, "python": platform.python_version(), "tensorflow": tf.__version__,
        "keras": keras.__version__, "numpy": np.__version__, "cpu_count": os.cpu_count(),
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "devices": devices, "load_average": os.getloadavg(),
    }


def _registered(name: str, devices: list[str]) -> str:
    """The registry name of ``name``: a ``module:NAME`` algorithm is registered for this run."""
    if ":" not in name:
        return name
    from towers.allreduce.machinery.registry import ALGORITHMS, Record, record_of
    from towers.allreduce.machinery.resolve import get

    fn = get(name, argument="--algorithms", devices=devices)
    configured = record_of(fn)
    if configured is not None:
        ALGORITHMS.register(configured.algorithm)
        return configured.name
    ALGORITHMS.register(Record(name, lambda: fn, summary="a user's algorithm (no record)"))
    return name


def fresh_folder(parent: Path) -> Path:
    """``parent/towers-bench-<date>-<time>``, with ``-2``, ``-3``… if that one exists."""
    stem = "towers-bench-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, k = parent / stem, 1
    while path.exists():
        k += 1
        path = parent / f"{stem}-{k}"
    return path


def run(args: argparse.Namespace) -> int:
    args.out = args.out or fresh_folder(Path.cwd())
    if args.workers:  # its own processes: towers.bench.workers (sizes in MB)
        from towers.bench import workers

        return workers.run(args.workers, args.out, args.sizes, args.rounds or 7)
    from towers.trace.schedule import start_devices

    devices = start_devices(args.towers)  # first: before TensorFlow runs any op
    from towers.bench import allreduce, costfit, memory, phases, report, training

    section = {"allreduce": allreduce.section, "costmodel": costfit.section,
               "training": training.section, "phases": phases.section, "memory": memory.section}
    if args.algorithms:
        args.algorithms = [_registered(name, devices) for name in args.algorithms]
    results: dict[str, Any] = {"environment": environment(devices)}
    ok = True
    for name in SECTIONS:
        if name in args.sections:
            start = time.perf_counter()
            ok = section[name](args, devices, results) and ok
            results.setdefault("seconds", {})[name] = time.perf_counter() - start
            print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    path = report.write_json(args.out / "bench.json", results)
    print(f"\nwrote {path} (and the CSV/PNG files beside it)")
    return 0 if ok else 1
