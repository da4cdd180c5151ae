"""TensorFlow's parameter-server tutorial redone with towers, on digits, on one machine.

::

    this process (the client)                      local servers it starts
    AsyncTrainer ── thread per worker ──────────▶  worker 0: CPU:0 CPU:1   (its towers)
      pull / push under one lock                  worker 1: CPU:0 CPU:1
      update log: who read which version          ps 0, ps 1: the variables (size_balanced)
    then: replay(log) in NumPy  == the ps weights, bitwise
          the same batches through ParameterServerStrategy + ClusterCoordinator
          (2 workers, 1 ps, in a child process): test accuracy and loss side by side

Run: python examples/parameter_server.py [--epochs 2] [--lr 0.3] [--momentum 0]
(the child: python examples/parameter_server.py --pss OUT.npz)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the reference package, and this checkout's towers

import numpy as np  # noqa: E402

BATCH = 64


def make_model():  # type: ignore[no-untyped-def]
    """The tutorial's small classifier: Flatten → Dense(32, relu) → Dense(10, softmax)."""
    import keras

    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu", kernel_initializer=init(1)),
        keras.layers.Dense(10, activation="softmax", kernel_initializer=init(2))])


def data(epochs: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    from towers.training.data import batches, digits

    x, y, x_test, y_test = digits()
    train = [b for e in range(epochs) for b in batches(x, y, BATCH, seed=e)]
    return train, x_test, y_test


def evaluate(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Test loss and accuracy of ``weights`` (a local model on this process's CPU)."""
    import keras

    model = make_model()
    for var, w in zip(model.trainable_variables, weights):
        var.assign(w)
    p = np.asarray(model(x))
    loss = float(np.mean(keras.losses.sparse_categorical_crossentropy(y, p)))
    return loss, float(np.mean(np.argmax(p, axis=1) == y))


def run_pss(out: str, epochs: int, lr: float, momentum: float) -> None:
    """The reference, in a process of its own: ParameterServerStrategy on the same batches."""
    import keras

    from reference.parameter_server import train_parameter_server
    from towers.cluster import start_servers

    train, _, _ = data(epochs)
    with start_servers(2, 1, ps=1, chief=True) as local:
        weights = train_parameter_server(
            local.cluster.cluster_spec(), make_model, train, learning_rate=lr,
            momentum=momentum, loss=keras.losses.sparse_categorical_crossentropy)
    np.savez(out, *weights)


def run_towers(epochs: int, lr: float, momentum: float, folder: Path,
               max_staleness: int | None = None) -> list[np.ndarray]:
    from towers.cluster import AsyncTrainer, connect_ps, load_log, replay, save_log, start_servers

    train, _, _ = data(epochs)
    with start_servers(2, 2, ps=2) as local:
        workers, ps = connect_ps(local.cluster, 2)
        trainer = AsyncTrainer(make_model, "sparse_categorical_crossentropy", workers=workers,
                               ps_devices=ps, learning_rate=lr, momentum=momentum,
                               policy="size_balanced", max_staleness=max_staleness)
        start = time.monotonic()
        log = trainer.run(train)
        stale = np.bincount([r.version - 1 - max(r.read.values()) for r in log.records])
        print(f"towers: {len(log.records)} async updates in {time.monotonic() - start:.1f} s "
              f"by workers {[sum(r.worker == w for r in log.records) for w in (0, 1)]}; "
              f"updates per staleness (0, 1, …): {stale.tolist()}; "
              f"refused stale pushes: {trainer.refused}")
        final = trainer.get_weights()
        initial = trainer.initial_weights()
    save_log(log, folder / "log")
    replayed = replay(load_log(folder / "log"), initial)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(replayed, final))
    bitwise = all(np.array_equal(a, b) for a, b in zip(replayed, final))
    print(f"replay of the saved log ({folder / 'log'}.json/.npz): max |diff| = {diff:g}, "
          f"bitwise equal: {bitwise}")
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--max-staleness", type=int, default=None)
    parser.add_argument("--pss", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pss:
        run_pss(args.pss, args.epochs, args.lr, args.momentum)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        child = subprocess.Popen([sys.executable, __file__, "--pss", str(folder / "pss.npz"),
                                  "--epochs", str(args.epochs), "--lr", str(args.lr),
                                  "--momentum", str(args.momentum)])
        ours = run_towers(args.epochs, args.lr, args.momentum, folder, args.max_staleness)
        if child.wait(timeout=600) != 0:
            raise SystemExit("the ParameterServerStrategy run failed (see above)")
        with np.load(folder / "pss.npz") as saved:
            theirs = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        _, x_test, y_test = data(1)
        for name, weights in (("towers async", ours), ("ParameterServerStrategy", theirs)):
            loss, accuracy = evaluate(weights, x_test, y_test)
            print(f"{name:>24}: test loss {loss:.4f}, accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip the runtime's teardown (its servers are gone already)
