"""A training run that tests/training/test_resume.py kills, restarts and compares.

``python -m tests.training.resume_run DIRECTORY OUT [CRASH_STAGE]`` trains the digits
for EPOCHS epochs with ``TowerModel.fit(callbacks=[ExactResume(DIRECTORY, every=EVERY)])``:
the same seeds and order every time (the digits shuffled once, seeded), so a run that is
killed and started again must end bitwise where an uninterrupted run ends. It prints
``batch <n>`` (flushed) after each trained batch — after that batch's checkpoint, if
one was due; a batch the resume skips prints nothing — and at the end writes every
replica's variables, every optimizer variable (slots, ``iterations``) and the
all-reduce's state to OUT (``.npz``).

With CRASH_STAGE (``data``, ``manifest``, ``renamed``, ``pointer``) the process
``os._exit(3)``s at that stage of its second save (see ``towers.training.checkpoint``).
"""

from __future__ import annotations

import os
import sys

import towers

DEVICES = towers.simulate_devices(3, kind="cpu")

import keras  # noqa: E402  (after the devices are configured)
import numpy as np  # noqa: E402

from towers.training import checkpoint  # noqa: E402
from towers.training.backup import ExactResume  # noqa: E402
from towers.training.data import digits  # noqa: E402

EPOCHS, EVERY, BATCH = 3, 4, 96


def make() -> keras.Model:
    init = keras.initializers.GlorotUniform
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu", kernel_initializer=init(0))(inp)
    h = keras.layers.Dropout(0.3, seed=7)(keras.layers.Flatten()(h))
    return keras.Model(inp, keras.layers.Dense(10, kernel_initializer=init(1))(h))


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if logs:  # a batch the resume skipped reports empty logs
            print(f"batch {batch}", flush=True)


def crash_at(stage: str) -> None:
    """``os._exit(3)`` where ``stage`` of the second save ends, as test_atomic.crashing_at
    places it: just before or after the manifest is written, or the pointer moved."""
    owner, name = (checkpoint, "_write_manifest") if stage in ("data", "manifest") \
        else (os, "replace")
    real, after, saves = getattr(owner, name), stage in ("manifest", "pointer"), [0]

    def crash() -> None:
        if saves[0] == 2:
            print(f"crash {stage}", flush=True)
            os._exit(3)

    def crashing(*args: object) -> None:
        saves[0] += 1
        if not after:
            crash()
        real(*args)
        crash()

    setattr(owner, name, crashing)


def main(directory: str, out: str, stage: str | None = None) -> None:
    if stage:
        crash_at(stage)
    tm = towers.TowerModel(make(), devices=DEVICES, all_reduce=towers.compressed("ring", "topk"),
                           variables="replicated")  # fmt: skip
    tm.compile(keras.optimizers.Adam(1e-2),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y, _, _ = digits()
    order = np.random.default_rng(5).permutation(len(x))
    tm.fit(x[order], y[order], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
           callbacks=[ExactResume(directory, every=EVERY), Report()])  # fmt: skip
    trainer = tm.trainer
    assert trainer is not None
    arrays = {}
    for i, replica in enumerate(trainer.replicas):
        for j, v in enumerate([*replica.model.variables, *replica.optimizer.variables]):
            arrays[f"r{i}_{j}"] = np.asarray(v.numpy())
    for j, v in enumerate(trainer.algorithm.variables):
        arrays[f"all_reduce_{j}"] = np.asarray(v.numpy())
    arrays["iterations"] = np.asarray(trainer.optimizer.iterations.numpy())
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:])
