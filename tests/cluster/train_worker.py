"""One worker of a between-graph run, for tests/cluster: unequal batches, checkpoints, faults.

Run under ``towers launch`` (every worker runs it). Step k trains on the global batch
``x[o_k : o_k + B_k]`` of the digits (``o_k`` = the sizes before it), this worker's part
cut by :func:`towers.cluster.cross_worker.worker_slice`. Prints ``RESTORED <step>
<digest>``, one ``STEP <k> <local batch> <digest>`` per step, then ``DONE <digest>``
(digest: SHA-256 of every replica's weights) or ``FAILED <error> <seconds>`` and exit 3.
``--die-at K`` makes
worker 1 kill itself with SIGKILL (``kill -9``) before step K, once the chief's
checkpoint of K steps exists; ``--nan-at K`` puts a NaN
into worker 0's part of step K (each STEP line then ends with the guard's skipped count,
and a ``NONFINITE <k> <towers>`` line reports a raised ``NonFiniteError``);
``--on-nonfinite`` picks the guard's mode.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64", help="global batch sizes, one per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=60.0, help="collective/step timeout")
    parser.add_argument("--ckpt", default=None, help="checkpoint directory")
    parser.add_argument("--die-at", type=int, default=None, help="worker 1 is killed here")
    parser.add_argument("--out", default=None, help="directory for weights after each step")
    parser.add_argument("--nan-at", type=int, default=None, help="worker 0's batch gets a NaN")
    parser.add_argument("--on-nonfinite", default="skip")
    return parser.parse_args()


def make_model():  # type: ignore[no-untyped-def]
    """The small dense classifier every worker (and the single-process reference) trains."""
    import keras

    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Flatten(),
        keras.layers.Dense(16, activation="tanh", kernel_initializer=init(1)),
        keras.layers.Dense(10, kernel_initializer=init(2))])


def digest(trainer) -> str:  # type: ignore[no-untyped-def]
    """SHA-256 over every replica's weights: equal digests mean bitwise equal replicas."""
    sha = hashlib.sha256()
    for replica in trainer.replicas:
        for w in replica.model.get_weights():
            sha.update(w.tobytes())
    return sha.hexdigest()[:16]


def barrier(workers: int) -> None:
    """Every worker reaches this point before any steps (start-up skew is not a fault)."""
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    from towers.allreduce.machinery.tf_collective_ops import shared_keys

    key = shared_keys(2)
    with tf.device("/device:CPU:0"):
        collective_ops.all_reduce_v2(tf.ones([1]), group_size=workers, group_key=key,
                                     instance_key=key + 1, merge_op="Add", final_op="Id",
                                     timeout=120.0)


def wait_for_checkpoint(folder: str | None, steps: int, limit: float = 60.0) -> None:
    """Return once the chief's checkpoint of ``steps`` steps exists (or after ``limit`` s).

    Worker 1 dies only after worker 0 finished the last step they share: killed as soon
    as its own part of that step returned, it could take down a buffer worker 0 was
    still pulling (gRPC ``RecvBuf``), and worker 0 would fail that step ("Socket
    closed", seen in CI) instead of waiting in the next one until its step timeout.
    """
    deadline = time.monotonic() + limit
    while folder and time.monotonic() < deadline:
        if os.path.isdir(os.path.join(folder, f"ckpt-{steps:08d}")):
            return
        time.sleep(0.05)


def main() -> None:
    """Train the steps; report as the module docstring says."""
    args = parse()
    from towers.cluster import leave_together, resolve, start_worker

    devices = start_worker()
    import keras
    import numpy as np

    import towers
    from towers.cluster.cross_worker import (
        WorkerTrainer,
        restore_latest,
        save_on_chief,
        worker_slice,
    )
    from towers.training.data import digits

    cluster = resolve()
    workers, worker = cluster.num_workers, int(cluster.task_index or 0)
    x, y, _, _ = digits()
    trainer = WorkerTrainer(
        make_model, lambda: keras.optimizers.SGD(args.lr),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), devices=devices,
        num_workers=workers, timeout_seconds=args.timeout, step_timeout=args.timeout,
        on_nonfinite=args.on_nonfinite)
    start = restore_latest(trainer, args.ckpt) if args.ckpt else 0
    print(f"RESTORED {start} {digest(trainer)}", flush=True)
    sizes = [int(b) for b in args.batches.split(",")]
    offsets = np.cumsum([0, *sizes])
    barrier(workers)
    before = trainer.get_weights()
    for step in range(start, len(sizes)):
        if step == args.die_at and worker == 1:
            wait_for_checkpoint(args.ckpt, step)
            os.kill(os.getpid(), signal.SIGKILL)
        part = worker_slice(sizes[step], workers, worker)
        xb, yb = x[offsets[step]:offsets[step + 1]][part], y[offsets[step]:offsets[step + 1]][part]
        if step == args.nan_at and worker == 0:
            xb = xb.copy()
            xb[0, 0, 0, 0] = np.nan
        began = time.monotonic()
        try:
            trainer.train_step(xb, yb)
        except towers.StepTimeout as err:
            print(f"FAILED {type(err).__name__} {time.monotonic() - began:.1f} {err}", flush=True)
            os._exit(3)  # the runtime's teardown would wait for the lost peer
        except towers.NonFiniteError as err:
            print(f"NONFINITE {step} {','.join(map(str, sorted(err.towers))) or '-'}", flush=True)
        print(f"STEP {step} {len(xb)} {digest(trainer)} {trainer.skipped_steps}", flush=True)
        if args.out:
            np.savez(os.path.join(args.out, f"w{worker}_{step}.npz"), *trainer.get_weights())
            if step == start:
                np.savez(os.path.join(args.out, f"init{worker}.npz"), *before)
        if args.ckpt:
            save_on_chief(trainer, args.ckpt, step + 1)  # steps taken, a skipped one too
    print(f"DONE {digest(trainer)}", flush=True)
    leave_together(cluster)


if __name__ == "__main__":
    main()
    os._exit(0)
