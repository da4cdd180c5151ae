"""``towers bench --workers W``: cross-process all-reduce throughput, towers beside MWMS.

W local workers (as ``towers launch``) time ``CrossWorker``, ``AllTowers`` and
MultiWorkerMirroredStrategy's ``all_reduce`` per size; worker 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import functools
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from towers.bench import report
from towers.cluster import launch, leave_together, local_cluster, resolve, set_logical_devices
from towers.cluster.cross_worker import AllTowers, CrossWorker
from towers.devices import set_local_task
from towers.guard.arguments import int_at_least, positive_int

__all__ = ["SIZES_MB", "main", "rows", "run"]

SIZES_MB = (1, 4, 16, 64)
_IMPLS = ("CrossWorker", "AllTowers", "MWMS")
_CPU = "/device:CPU:0"


def _functions(strategy: Any, workers: int, elements: int) -> dict[str, Any]:
    with tf.device(_CPU):
        probe = tf.Variable(tf.zeros([elements]))
    cross = CrossWorker(workers, op="sum", timeout_seconds=300.0)
    flat = AllTowers(workers, op="sum", timeout_seconds=300.0)
    for reducer in (cross, flat):
        reducer.build([probe], [_CPU])

    def replica(v: tf.Tensor) -> tf.Tensor:
        with tf.device(_CPU):  # MWMS reduces "to the value's devices": give it one
            v = tf.identity(v)
        return tf.distribute.get_replica_context().all_reduce("sum", v)

    mwms = tf.function(lambda x: strategy.run(replica, args=(x,)))
    return {
        "CrossWorker": tf.function(lambda x: cross.reduce_gradients([[x]])[0][0]),
        "AllTowers": tf.function(lambda x: flat.reduce_gradients([[x]])[0][0]),
        # MWMS's input is a distributed value (one local replica), as in its tutorials
        "MWMS": lambda x: mwms(strategy.experimental_distribute_values_from_function(
            lambda _: x)),
    }


def _time_size(strategy: Any, workers: int, megabytes: int, rounds: int) -> dict[str, Any]:
    """Median and minimum seconds of each implementation for one size, timed interleaved
    (the same seeded order on every worker, so their collectives meet)."""
    elements = megabytes * 2**20 // 4
    with tf.device(_CPU):
        x = tf.constant(np.ones(elements, np.float32))
    calls = {name: functools.partial(lambda fn: np.asarray(fn(x)), fn)
             for name, fn in _functions(strategy, workers, elements).items()}
    for name, call in calls.items():  # trace and check (the first call meets the group)
        if not np.all((out := call()) == workers):
            raise RuntimeError(f"{name}: an all-reduce of ones gave {out[:4]}…")
    samples = report.interleave(calls, rounds, warmup=0)
    return {"megabytes": megabytes, "workers": workers,
            "median_s": {k: s.median for k, s in samples.items()},
            "min_s": {k: s.minimum for k, s in samples.items()}}


def main(sizes: list[int], rounds: int) -> None:
    """One worker's part (run under the launcher): time every size (MB), worker 0 reports."""
    cluster = resolve()
    set_logical_devices(1)
    ring = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=ring))
    set_local_task(str(cluster.task_type), int(cluster.task_index or 0))
    for mb in sizes:
        result = _time_size(strategy, cluster.num_workers, mb, rounds)
        if cluster.is_chief:
            print("RESULT " + json.dumps(result), flush=True)
    leave_together(cluster)  # a peer may still be pulling this worker's last buffer
    os._exit(0)  # the collective runtime's teardown may wait on its peers


def rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The CSV rows (one per size and implementation) from the workers' RESULT lines."""
    out = []
    for r in results:
        w = r["workers"]
        for impl in _IMPLS:
            t = r["median_s"][impl]
            algbw = r["megabytes"] * 2**20 / t / 1e9
            out.append({"workers": w, "megabytes": r["megabytes"], "impl": impl,
                        "median_s": f"{t:.5f}", "min_s": f"{r['min_s'][impl]:.5f}",
                        "algbw_GBps": f"{algbw:.3f}",
                        "busbw_GBps": f"{algbw * 2 * (w - 1) / w:.3f}",
                        "ratio_to_mwms": f"{t / r['median_s']['MWMS']:.3f}"})
    return out


def run(workers: int, out_dir: Path, sizes: list[int] | None = None, rounds: int = 7,
        timeout: float = 600.0) -> int:
    """Launch the workers, print the table, write ``out_dir/workers.csv``; exit code."""
    sizes = list(sizes or SIZES_MB)
    int_at_least("workers", workers, 2)
    positive_int("rounds", rounds)
    for size in sizes:
        positive_int("sizes (MB)", size)
    text = io.StringIO()
    program = f"from towers.bench.workers import main; main({sizes!r}, {rounds!r})"
    code = launch(local_cluster(workers), 1, [sys.executable, "-c", program], timeout=timeout,
                  out=text)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in text.getvalue().splitlines()
               if line.startswith("[worker 0] RESULT ")]
    if code != 0 or len(results) != len(sizes):
        print(text.getvalue()[-4000:])
        return code or 1
    table = rows(results)
    for row in table:
        print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    print(f"wrote {report.write_csv(out_dir / 'workers.csv', table)}")
    return 0

