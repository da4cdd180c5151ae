"""Asynchronous ps training, run as its own process (it connects to a cluster).

``python tests/cluster/ps_client.py MODE OUT_DIR``; MODE:

- ``async``: 2 workers × 2 towers + 2 ps; async SGD with momentum over 12 batches; writes
  the log (``log.json``/``log.npz``), ``initial.npz``, ``final.npz``, and ``recompute.npz``
  (each logged update's gradient recomputed by its worker on the replayed weights of
  the version it says it read), plus ``sync.npz``: 1 worker async vs TowerTrainer.
  Then ps 1 is stopped and training goes on: ``fault.json`` holds the error type,
  message and the seconds it took.
- ``pss``: ParameterServerStrategy + ClusterCoordinator (2 workers, 1 ps) on the same
  batches: ``pss.npz`` (final weights) or ``pss_error.txt``.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

TOWERS, BATCHES, BATCH, LR, MOMENTUM = 2, 12, 10, 0.05, 0.5


def make_model():  # type: ignore[no-untyped-def]
    import keras

    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((6,)),
                             keras.layers.Dense(5, activation="tanh", kernel_initializer=init(1)),
                             keras.layers.Dense(3, kernel_initializer=init(2))])


def batches(n: int = BATCHES, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """A linear teacher plus noise, so that a run's held-out loss shows what it learned."""
    teacher = np.random.default_rng(99).normal(size=(6, 3)).astype("float32") * 0.5
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(BATCH, 6)).astype("float32")
        noise = rng.normal(size=(BATCH, 3)).astype("float32") * 0.1
        out.append((x, (x @ teacher + noise).astype("float32")))
    return out


def run_async(out: str) -> None:
    from towers.cluster import connect_ps, start_servers
    from towers.cluster.ps_train import AsyncTrainer, replay_versions, save_log

    data = batches()
    with start_servers(2, TOWERS, ps=2) as local:
        workers, ps = connect_ps(local.cluster, TOWERS)
        trainer = AsyncTrainer(make_model, "mse", workers=workers, ps_devices=ps,
                               learning_rate=LR, momentum=MOMENTUM, policy="size_balanced")
        start = time.monotonic()
        log = trainer.run(data)
        seconds = time.monotonic() - start
        save_log(log, os.path.join(out, "log"))
        np.savez(os.path.join(out, "initial.npz"), *trainer.initial_weights())
        np.savez(os.path.join(out, "final.npz"), *trainer.get_weights())
        versions = list(replay_versions(log, trainer.initial_weights()))
        recomputed = {}
        for u, r in enumerate(log.records):
            grads = worker_gradient(trainer.workers[r.worker], versions[max(r.read.values())],
                                    *data[r.batch])
            recomputed.update({f"u{u}_v{i}": g for i, g in enumerate(grads)})
        np.savez(os.path.join(out, "recompute.npz"), **recomputed)
        sync = one_worker_vs_tower_trainer(workers[0], ps[0], data[:3])
        np.savez(os.path.join(out, "sync.npz"), **sync)
        with open(os.path.join(out, "meta.json"), "w") as f:
            json.dump({"seconds": seconds, "refused": trainer.refused,
                       "placement": log.placement}, f)
        lose_a_ps(local, trainer, data[:2], out)


def worker_gradient(worker, weights, x, y):  # type: ignore[no-untyped-def]
    """A worker's gradient on ``(x, y)`` at ``weights``, through the trainer's public phases."""
    import tensorflow as tf

    from towers.split import batch_tensors

    targets = worker.model.trainable_variables
    # one function call, as the pull: remote eager assigns would run asynchronously
    tf.function(lambda values: [v.assign(w) for v, w in zip(targets, values)],
                autograph=False)([tf.constant(np.asarray(w, np.float32)) for w in weights])
    for var, w in zip(targets, weights):
        assert np.array_equal(var.numpy(), w), "the worker's weights were not set"
    x, y, _ = batch_tensors(x, y, None, worker.model)
    grads = tf.function(lambda x, y: worker.reduce(worker.forward_backward(worker.split(x, y))
                                                   ).grads[0], autograph=False)(x, y)
    return [g.numpy() for g in grads]


def one_worker_vs_tower_trainer(towers: list[str], ps: str,
                                data: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    import keras

    import towers as towers_pkg
    from towers.cluster.ps_train import AsyncTrainer

    trainer = AsyncTrainer(make_model, "mse", workers=[towers], ps_devices=[ps], learning_rate=LR,
                           momentum=MOMENTUM)
    trainer.run(data)
    sync = towers_pkg.TowerTrainer(make_model, keras.optimizers.SGD(LR, momentum=MOMENTUM), "mse",
                                   devices=towers,
                                   all_reduce="naive", variables="parameter_device",
                                   parameter_device=ps)
    for x, y in data:
        sync.train_step(x, y)
    result = {f"async_{i}": w for i, w in enumerate(trainer.get_weights())}
    result.update({f"sync_{i}": w for i, w in enumerate(sync.model.trainable_variables)})
    return {k: np.asarray(v) for k, v in result.items()}


def lose_a_ps(local, trainer, data, out: str) -> None:  # type: ignore[no-untyped-def]
    """Stop ps 1 and train on: the error, its type and how long it took go to fault.json."""
    local.stop("ps", 1)
    trainer.store.timeout = 10.0
    report: dict[str, object] = {}
    start = time.monotonic()
    try:
        trainer.run(data)
        report["error"] = None
    except Exception as err:
        report.update(error=type(err).__name__, message=str(err),
                      towers_error=type(err).__module__.startswith("towers"))
    report["seconds"] = time.monotonic() - start
    with open(os.path.join(out, "fault.json"), "w") as f:
        json.dump(report, f)


def run_pss(out: str) -> None:
    """ParameterServerStrategy (2 workers, 1 ps) on the same batches; final weights or error."""
    from reference.parameter_server import train_parameter_server
    from towers.cluster import start_servers

    with start_servers(2, 1, ps=1, chief=True) as local:
        try:
            weights = train_parameter_server(local.cluster.cluster_spec(), make_model,
                                             batches(), learning_rate=LR, momentum=MOMENTUM)
            np.savez(os.path.join(out, "pss.npz"), *weights)
        except Exception as err:
            with open(os.path.join(out, "pss_error.txt"), "w") as f:
                f.write(f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    {"async": run_async, "pss": run_pss}[sys.argv[1]](sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # skip the runtime's teardown (it may wait for a stopped task)
