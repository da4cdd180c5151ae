"""Train a small CNN on the bundled digits over simulated towers, then check it.

Keras as a user writes it (``towers.TowerModel``, ``compile``, ``fit``); the same batches
then replay through MirroredStrategy and the largest weight difference is printed: the
hand-built step computes what MirroredStrategy computes.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from towers.cli.arguments import VARIABLES, algorithm, at_least, codec, positive_float

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--towers", type=at_least(1), default=4, help="simulated devices")
    add("--algorithm", type=algorithm, default="naive",
        help="all-reduce: a registered name or module:NAME")
    add("--codec", type=codec, default=None,
        help="compress the gradients with this codec over --algorithm: a registered name "
        "(fp16, bf16, topk, powersgd, identity) or module:NAME")
    add("--variables", default="replicated", choices=VARIABLES, help="variable placement")
    add("--epochs", type=at_least(1), default=6, help="epochs")
    add("--batch-size", type=at_least(1), default=64, help="global batch")
    add("--lr", type=positive_float, default=3e-3, help="Adam learning rate")
    add("--seed", type=at_least(0), default=0, help="seed for weights and shuffling")
    add("--reference", default="auto",
        choices=("auto", "collective", "reduction_to_one_device", "none"),
        help="MirroredStrategy cross-device ops to compare against (default auto: the one "
        "that adds in the same order as --algorithm when there is one)")  # fmt: skip


def _accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    logits = model.predict(x, batch_size=512, verbose=0)
    return float(np.mean(np.argmax(logits, axis=1) == y))


def _fit_towers(tm: Any, data: tuple[np.ndarray, ...], args: argparse.Namespace) -> None:
    """``tm.fit`` one epoch per call, on the order the reference replays."""
    x_train, y_train, _, _ = data
    for epoch in range(args.epochs):
        order = np.random.default_rng(args.seed + epoch).permutation(len(x_train))
        history = tm.fit(x_train[order], y_train[order], batch_size=args.batch_size,
                         epochs=1, shuffle=False, verbose=1)
        print(f"towers epoch {epoch + 1}/{args.epochs}: loss {history.history['loss'][-1]:.4f}  "
              f"train accuracy {_accuracy(tm, x_train, y_train):.4f}")


def _compare(tm: Any, data: tuple[np.ndarray, ...], args: argparse.Namespace,
             devices: list[str]) -> None:
    """Replay the same batches through MirroredStrategy; print the largest weight difference."""
    import keras

    from reference import MirroredTrainer
    from towers.training.data import batches
    from towers.training.models import digits_cnn

    kind = args.reference if args.reference != "auto" else (
        "reduction_to_one_device" if args.algorithm in ("naive", "parameter_device")
        else "collective")
    print(f"replaying the same {args.epochs} epochs with MirroredStrategy ({kind}) ...")
    ref = MirroredTrainer(lambda: digits_cnn(args.seed), lambda: keras.optimizers.Adam(args.lr),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          devices=devices, cross_device_ops=kind)
    for epoch in range(args.epochs):
        for xb, yb in batches(data[0], data[1], args.batch_size, args.seed + epoch):
            ref.train_step(xb, yb)
    diffs = [float(np.max(np.abs(a - b))) for a, b in zip(tm.get_weights(), ref.get_weights())]
    scale = max(float(np.max(np.abs(w))) for w in ref.get_weights())
    print(f"largest weight difference to MirroredStrategy ({kind}): {max(diffs):.3g} "
          f"(largest weight {scale:.3g}; float32 epsilon 1.19e-07)")
    print(f"reference test accuracy: {_accuracy(ref.model, data[2], data[3]):.4f}")


def run(args: argparse.Namespace) -> int:
    from towers.trace.schedule import start_devices

    devices = start_devices(args.towers)  # first: before TensorFlow's runtime starts
    import keras

    import towers
    from towers.allreduce.machinery.resolve import get
    from towers.training.data import digits
    from towers.training.models import digits_cnn

    data = digits(seed=args.seed)
    print(f"towers train: {args.towers} towers {devices}, all_reduce={args.algorithm}, "
          f"variables={args.variables}, codec={args.codec}, {len(data[0])} training / "
          f"{len(data[2])} test digits")
    start = time.perf_counter()
    reducer: Any = (get(args.algorithm, argument="algorithm", devices=devices)
                    if ":" in args.algorithm else args.algorithm)
    if args.codec is not None:
        reducer = towers.compressed(reducer, args.codec)
    tm = towers.TowerModel(digits_cnn(args.seed), devices=devices, all_reduce=reducer,
                           variables=args.variables)
    tm.compile(keras.optimizers.Adam(args.lr),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    _fit_towers(tm, data, args)
    print(f"test accuracy: {_accuracy(tm, data[2], data[3]):.4f}   "
          f"({time.perf_counter() - start:.1f} s)")
    if args.reference != "none":
        _compare(tm, data, args, devices)
    return 0
