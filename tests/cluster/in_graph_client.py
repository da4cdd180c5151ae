"""In-graph mode, run as its own process: one client drives the towers of every task.

``python tests/cluster/in_graph_client.py client OUT.npz``: serve 2 workers × 2 logical
CPUs (``towers.cluster.start_servers``), connect, check a tf.function over the four
remote towers, then train a Dense model 2 steps with ``TowerTrainer(all_reduce="naive")``
on the remote tower names. ``... reference OUT.npz``: the same training on 4 local towers.
Whatever happens is written to OUT.npz (``error`` holds an exception's message).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

STEPS, BATCH = 2, 12


def make_model():  # type: ignore[no-untyped-def]
    import keras

    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, kernel_initializer=init(1)),
                             keras.layers.Dense(3, kernel_initializer=init(2))])


def train(devices: list[str]) -> list[np.ndarray]:
    """Two SGD steps of the Dense model over ``devices`` (naive: tower order on tower 0)."""
    import keras

    import towers

    rng = np.random.default_rng(0)
    trainer = towers.TowerTrainer(make_model, lambda: keras.optimizers.SGD(0.1), "mse",
                                  devices=devices, all_reduce="naive", variables="replicated")
    for _ in range(STEPS):
        x = rng.normal(size=(BATCH, 5)).astype("float32")
        y = rng.normal(size=(BATCH, 3)).astype("float32")
        trainer.train_step(x, y)
    return trainer.get_weights()


def remote_sum(devices: list[str]) -> np.ndarray:
    """Each remote tower doubles its own row; the rows are added in tower order on tower 0."""
    import tensorflow as tf

    @tf.function
    def run() -> tf.Tensor:
        parts = []
        for i, d in enumerate(devices):
            with tf.device(d):
                parts.append(tf.fill([3], float(i + 1)) * 2.0)
        with tf.device(devices[0]):
            return tf.add_n(parts)

    return np.asarray(run().numpy())


def main(mode: str, out: str) -> None:
    results: dict[str, object] = {}
    if mode == "reference":
        import towers

        weights = train(towers.simulate_devices(4))
        np.savez(out, *weights)
        return
    from towers.cluster import connect, start_servers

    with start_servers(2, 2) as local:
        devices = connect(local.cluster, 2)
        results["devices"] = np.array(devices)
        results["remote_sum"] = remote_sum(devices)
        try:
            for i, w in enumerate(train(devices)):
                results[f"arr_{i}"] = w
        except Exception as err:
            results["error"] = np.array(f"{type(err).__name__}: {err}")
    np.savez(out, **results)  # type: ignore[arg-type]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
