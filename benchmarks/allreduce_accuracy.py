"""Per algorithm: largest error against the exact sum (in float32 ULPs) and bytes per tower.

Run: ``python benchmarks/allreduce_accuracy.py`` (simulates 8 CPU devices). For each
registered algorithm and n in (4, 8) it all-reduces random float32 vectors (sizes
1000 and 1031, signed values with cancellation), compares every output with the exact
sum (float64 accumulation of float32 inputs is exact here: 8 terms of 24 bits fit in
53), and counts the bytes each tower sends at ``send`` next to the module's formula.
"""

from __future__ import annotations

import towers

DEVICES = towers.simulate_devices(8)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from towers.allreduce import ALGORITHMS, Configured, get, record  # noqa: E402
from towers.testing import ulp_distance  # noqa: E402
from towers.testing.bounds import unit_roundoff  # noqa: E402


def _formula(fn: object, n: int, nbytes: int) -> str:
    """The registry record's bytes per tower (marked when it is an estimate)."""
    per = fn.bytes_sent(n, nbytes, 4) if isinstance(fn, Configured) else None
    if per is None:
        return "-"
    text = "/".join(str(int(b)) for b in sorted(set(per)))
    return f"~{text} (estimate)" if fn.algorithm.estimated else text


def main() -> None:
    rng = np.random.default_rng(0)
    head = ["algorithm", "n", "max ULPs", "max err / (u·Σ|x|)", "bytes/tower (S=4000)", "formula"]
    print(f"{head[0]:20s} {head[1]:>2s} {head[2]:>9s} {head[3]:>19s} {head[4]:>21s} {head[5]:>18s}")
    for name in sorted(ALGORITHMS):
        fn = get(name)
        for n in (4, 8):
            worst = 0
            ratio = 0.0
            sent = ""
            for size in (1000, 1031):
                arrays = [
                    (rng.normal(size=size) * 10.0 ** rng.integers(-2, 3)).astype("float32")
                    for _ in range(n)
                ]
                values = []
                for a, d in zip(arrays, DEVICES[:n]):
                    with tf.device(d):
                        values.append(tf.constant(a))
                with record() as rec:
                    outs = fn(values, op="sum")
                exact64 = np.sum(np.stack(arrays).astype(np.float64), axis=0)
                exact = exact64.astype(np.float32)
                worst = max(worst, max(int(np.max(ulp_distance(o.numpy(), exact))) for o in outs))
                magnitude = np.sum(np.abs(np.stack(arrays).astype(np.float64)), axis=0)
                scale = unit_roundoff("float32") * magnitude
                for o in outs:
                    err = np.abs(o.numpy().astype(np.float64) - exact64)
                    ratio = max(ratio, float(np.max(err / scale)))
                if size == 1000:
                    per = rec.bytes_sent()
                    sent = "/".join(str(b) for b in sorted(set(per.values()))) or "0"
                    formula = _formula(fn, n, size * 4)
            print(f"{name:20s} {n:2d} {worst:9d} {ratio:19.2f} {sent:>21s} {formula:>18s}")


if __name__ == "__main__":
    main()
