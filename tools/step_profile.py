"""How many towers modules and functions one ``TowerModel.fit`` step enters.

Profiles the Python calls of ``fit`` over one batch (tracing included) with
``sys.setprofile`` and counts the distinct files and functions under ``towers/`` it
enters: the measure of how far a reader follows one step through the package.

Python 3.11 runs each comprehension (``<listcomp>``, ``<genexpr>``, ``<dictcomp>``,
``<setcomp>``) in a frame of its own, which the profiler sees; Python 3.12+ inlines all but
generator expressions. So two counts are printed: the functions written with ``def`` or
``lambda``, and every frame entered, comprehensions included.

    python tools/step_profile.py [--towers 4] [--list]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

COMPREHENSIONS = {"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>"}
"""The code names of comprehension frames (not functions a reader wrote)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--list", action="store_true", help="print every module and function")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's towers
    import towers

    devices = towers.simulate_devices(args.towers)
    import keras
    import numpy as np

    package = str(Path(towers.__file__).resolve().parent)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])  # fmt: skip
    tm = towers.TowerModel(model, devices=devices)
    tm.compile(keras.optimizers.SGD(0.1),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.zeros(32, "int64")

    seen: set[tuple[str, str]] = set()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            path = str(Path(frame.f_code.co_filename).resolve())
            if path.startswith(package):
                seen.add((path[len(package) + 1:], frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        tm.fit(x, y, batch_size=32, epochs=1, verbose=0)
    finally:
        sys.setprofile(None)
    modules = sorted({m for m, _ in seen})
    written = {(m, f) for m, f in seen if f.rsplit(".", 1)[-1] not in COMPREHENSIONS}
    print(f"one fit step: {len(modules)} towers modules, {len(written)} functions"
          f" (def/lambda; {len(seen)} frames with comprehensions, Python"
          f" {sys.version_info.major}.{sys.version_info.minor})")
    if args.list:
        for module in modules:
            print(module, sorted(f for m, f in seen if m == module))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
