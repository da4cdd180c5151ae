"""What the non-finite guard costs one training step: ``on_nonfinite="skip"`` against
``"ignore"``, in one process.

Both trainers run the same model, batch and algorithm on simulated devices; their steps
alternate, so a machine's load weighs on both alike. Prints each one's median and the ratio.

    python tools/guard_cost.py [--model mlp] [--algorithm ring] [--variables replicated]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", help="conv-mnist or mlp")
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--variables", default="replicated")
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's towers
    import towers  # after argparse: --help needs no TensorFlow

    devices = towers.simulate_devices(args.towers, kind="cpu")
    import keras

    from towers.bench.training import MODELS, make_batch

    x, y = make_batch(args.model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainers = {mode: towers.TowerTrainer(
        MODELS[args.model][0], lambda: keras.optimizers.SGD(0.01), loss, devices=devices,
        all_reduce=args.algorithm, variables=args.variables, on_nonfinite=mode)
        for mode in ("skip", "ignore")}
    for trainer in trainers.values():
        for _ in range(3):  # trace and warm up
            trainer.train_step(x, y)
    times: dict[str, list[float]] = {mode: [] for mode in trainers}
    for _ in range(args.steps):
        for mode, trainer in trainers.items():
            start = time.perf_counter()
            float(trainer.train_step(x, y))
            times[mode].append(time.perf_counter() - start)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    for mode, median in medians.items():
        print(f"on_nonfinite={mode!r}: median {median * 1e3:.1f} ms")
    print(f"skip / ignore: {medians['skip'] / medians['ignore']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
