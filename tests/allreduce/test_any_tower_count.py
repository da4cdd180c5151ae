"""Every registered algorithm at 11, 12, 16 and 32 towers, every output against NumPy.

The suite's process has 8 logical devices (tests/conftest.py), so one subprocess
simulates 32 and runs every algorithm there. TensorFlow's own ``all_to_all_v2``
misroutes from 12 ranks (towers.allreduce.machinery.tf_collective_ops), and 11
is the last count before that: ``nccl_ring`` must be right on both sides of it. The
collective executor's threads stay bounded over all of it (a thread per op used to
sleep out each op's timeout: 30,000 threads, and a crash where threads are capped).

Inputs: integer-valued floats, whose sums are exact in any order (every output
equals NumPy's bitwise, for ``sum``, ``mean`` — the sum divided by ``n`` once — and
``max``); and random floats, each output within the algorithm's bound
(:func:`towers.testing.bounds.sum_bound` at its summation depth).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import towers

ROOT = Path(__file__).resolve().parents[2]
COUNTS = (11, 12, 16, 32)

_SCRIPT = """
import json, os, sys
import numpy as np
import towers
devices = towers.simulate_devices(32)
import tensorflow as tf
from towers.testing.bounds import sum_bound

def place(arrays):
    out = []
    for array, device in zip(arrays, devices):
        with tf.device(device):
            out.append(tf.constant(array))
    return out

failures, rng = [], np.random.default_rng(0)
for name in sorted(towers.ALGORITHMS):
    algorithm = towers.ALGORITHMS[name]()
    for n in COUNTS:
        ints = [rng.integers(-1000, 1000, (5, 7)).astype(np.float32) for _ in range(n)]
        exact = {"sum": np.sum(ints, axis=0, dtype=np.float64).astype(np.float32),
                 "max": np.max(ints, axis=0)}
        exact["mean"] = (exact["sum"] / np.float32(n)).astype(np.float32)
        for op, want in exact.items():
            outs = algorithm(place(ints), op=op)
            bad = [i for i, out in enumerate(outs) if not np.array_equal(out.numpy(), want)]
            if len(outs) != n or bad:
                failures.append(f"{name} n={n} {op} integer-valued: towers {bad} differ")
        floats = [(rng.standard_normal(37) * 10.0 ** rng.integers(-3, 4, 37)).astype(np.float32)
                  for _ in range(n)]
        for op in ("sum", "mean"):
            want, tol = sum_bound(floats, op, algorithm.summation_depth(n))
            outs = algorithm(place(floats), op=op)
            bad = [i for i, out in enumerate(outs)
                   if not np.all(np.abs(out.numpy().astype(np.float64) - want) <= tol)]
            if bad:
                failures.append(f"{name} n={n} {op} random floats: towers {bad} outside the bound")
        print(name, n, flush=True, file=sys.stderr)
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
if threads.count("collective_ops") > 4 * 32:  # the most ever blocked at once: ≤ 2 per tower
    failures.append(f"{threads.count('collective_ops')} collective threads (op timeouts?)")
print(json.dumps(failures))
"""


@pytest.mark.long
def test_every_algorithm_at_11_12_16_and_32_towers() -> None:
    script = f"COUNTS = {COUNTS!r}\n" + textwrap.dedent(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=1500, env=env, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures == [], failures
    done = {tuple(line.split()) for line in result.stderr.splitlines() if len(line.split()) == 2}
    assert {(name, str(n)) for name in towers.ALGORITHMS for n in COUNTS} <= done
