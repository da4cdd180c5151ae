"""The classic codec comparison on the bundled digits: none, fp16, top-k, PowerSGD.

Trains the digits CNN on 4 simulated towers once per reducer, from the same weights
on the same batches (``towers.bench.study.run_study``), and prints what each step sent
and what the α-β-γ model predicts that would cost on 8 H100s (NVLink) and on 1024
(InfiniBand between nodes), beside the final loss and test accuracy. Writes
``study_codecs.csv`` (one row per step) and ``study_codecs.png`` (loss against bytes
and against predicted time), as ``towers study`` does.

What it teaches (Vogels et al. 2019, in miniature): PowerSGD sends about a tenth
of the bytes of the uncompressed ring (fp16 a half, top-k(0.1) gathered from every
tower 0.4 at 4 towers, growing with the tower count), and error feedback keeps its
loss near the others'. But on this small model every all-reduce is latency-bound (a
few kB per variable), so the predicted time is α per message, not β per byte:
compression buys bytes, not time, and PowerSGD's two all-reduces per matrix cost
more. A ring over 1024 GPUs pays 2(N-1) messages per call; an all-reduce with log N
steps (``fp16@halving_doubling``) is the cure there, not a codec.

Run:  python examples/study_codecs.py [--epochs 2] [--steps K] [--out study_codecs]
"""

from __future__ import annotations

import argparse
import time

import towers

REDUCERS = ["ring", "fp16", "topk(0.1)", "powersgd(4)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1, help="epochs per reducer (default 1)")
    parser.add_argument("--steps", type=int, default=None,
                        help="stop each run after this many steps (default: every epoch)")
    parser.add_argument("--out", default="study_codecs", help="prefix of the CSV and PNG")
    args = parser.parse_args()
    if args.epochs < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--epochs and --steps must be at least 1")
    devices = towers.simulate_devices(4)  # first thing: before TensorFlow starts
    from towers.bench import study

    start = time.perf_counter()
    rows = study.run_study(REDUCERS, devices, epochs=args.epochs, eval_every=5,
                           steps=args.steps, progress=lambda line: print("  " + line, flush=True))
    print()
    print(study.summary_table(rows))
    print(f"\nsteps: {study.write_csv(rows, args.out + '.csv')}")
    print(f"curves: {study.plot(rows, args.out + '.png')}")
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
