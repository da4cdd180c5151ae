"""Train on several worker processes with towers, beside MultiWorkerMirroredStrategy.

What it teaches: between-graph data parallelism, TensorFlow's multi-worker way. Every
worker runs this same program with its own TF_CONFIG; each trains its own towers with
``TowerTrainer`` and ``CrossWorker``, which sums the worker's towers in tower order and
then all-reduces across workers with TF collective ops. The same process also trains
the same model with MultiWorkerMirroredStrategy (MWMS) on the same global batches and
prints the largest weight difference::

    global batch (64) ─split over workers─▶ worker k: 32 ─split over towers─▶ 16, 16
    (MirroredStrategy's rule at both levels; MWMS replica k·T + i gets the same 16)

Run it under the launcher (or alone: one worker)::

    python -m towers launch --workers 2 --towers-per-worker 2 -- \\
        python examples/multi_worker.py --steps 2

The bound. Both runs compute bitwise the same per-tower gradients (each worker divides
by its local batch and CrossWorker by W = 2: exact scalings by powers of two). They add
the W·T of them in different orders: towers ((g00 + g01) + (g10 + g11)), depth
d_t = (T − 1) + (W − 1); MWMS's ring over all W·T replicas, depth d_m = W·T − 1. Each
sum is within γ_d·S of the exact one (S = Σ|g_i| per element; γ_d = d·u/(1 − d·u),
u = 2⁻²⁴, Higham §4.2), so one step's gradients differ by at most (γ_dt + γ_dm)·S and
its SGD update by lr·(γ_dt + γ_dm)·max S + 2 ulp of the largest weight. A difference
already in the weights is carried into the next step; assuming lr·L ≤ 1 for the
gradient's Lipschitz constant L (true for this small model and lr), it at most doubles
per later step: bound = Σ_k b_k·2^(K−k). MWMS runs on the same logical CPUs as the
towers (its CPU default is one replica per worker; the example widens it to T).

Bitwise (``--order mwms``, trained beside the other by default): ``WorkerTrainer``
divides every tower's loss by the global batch (all-reducing the workers' counts, so
any batch size works) and ``AllTowers`` makes every tower a member of ONE collective
of W·T, packing the gradients as MWMS does (reversed, flattened, concatenated): the
same ring adds the same vectors in the same order, and the weights equal MWMS's
bit for bit (the example prints "bitwise equal: True")::

    python -m towers launch --workers 2 --towers-per-worker 2 -- \\
        python examples/multi_worker.py --order mwms --batch-size 61
"""

from __future__ import annotations

import argparse
import itertools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def make_model():  # type: ignore[no-untyped-def]
    """A small dense classifier of 8×8 digits, deterministic weights."""
    import keras

    init = keras.initializers.GlorotUniform
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh", kernel_initializer=init(1)),
        keras.layers.Dense(10, kernel_initializer=init(2)),
    ])


def mwms_over_logical_cpus(towers_per_worker: int):  # type: ignore[no-untyped-def]
    """MultiWorkerMirroredStrategy from TF_CONFIG with T logical CPUs per worker (ring)."""
    import tensorflow as tf
    from tensorflow.python.distribute import collective_all_reduce_strategy as mwms

    extended = mwms.CollectiveAllReduceExtended
    original = extended._initialize_local_devices

    def local_cpus(self, resolver, worker_device):  # type: ignore[no-untyped-def]
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(towers_per_worker)), "CPU"

    extended._initialize_local_devices = local_cpus
    try:
        ring = tf.distribute.experimental.CommunicationImplementation.RING
        return tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=ring))
    finally:
        extended._initialize_local_devices = original


class MWMSTrainer:
    """The custom-training-loop tutorial over MWMS, fed this worker's tower shards."""

    def __init__(self, strategy, lr: float, worker: int, towers: int) -> None:  # type: ignore[no-untyped-def]
        import keras
        import tensorflow as tf

        self.strategy, self.worker, self.towers = strategy, worker, towers
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        with strategy.scope():
            self.model = make_model()
            self.optimizer = keras.optimizers.SGD(lr)
            self.optimizer.build(self.model.trainable_variables)
        self._step = tf.function(self._distributed_step)

    def train_step(self, shards, global_batch: int):  # type: ignore[no-untyped-def]
        """One step; returns (global loss, Σ over replicas of |gradient|, per variable)."""
        import tensorflow as tf

        def value(ctx):  # type: ignore[no-untyped-def]
            return shards[ctx.replica_id_in_sync_group - self.worker * self.towers]

        inputs = self.strategy.experimental_distribute_values_from_function(value)
        return self._step(inputs, tf.constant(global_batch, tf.int32))

    def _distributed_step(self, inputs, global_batch):  # type: ignore[no-untyped-def]
        import tensorflow as tf

        loss, magnitudes = self.strategy.run(self._replica_step, args=(*inputs, global_batch))
        total = tf.distribute.ReduceOp.SUM
        return (self.strategy.reduce(total, loss, axis=None),
                [self.strategy.reduce(total, m, axis=None) for m in magnitudes])

    def _replica_step(self, x, y, global_batch):  # type: ignore[no-untyped-def]
        import tensorflow as tf

        with tf.GradientTape() as tape:
            per_ex = self.loss.call(y, self.model(x, training=True))
            loss = tf.nn.compute_average_loss(per_ex, global_batch_size=global_batch)
        variables = self.model.trainable_variables
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables, strict=True))
        return loss, [tf.abs(g) for g in grads]


def gamma(depth: int) -> float:
    """γ_d = d·u / (1 − d·u) for float32 (Higham §4.2)."""
    u = 2.0**-24
    return depth * u / (1 - depth * u)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--no-reference", action="store_true", help="skip the MWMS run")
    parser.add_argument("--order", choices=("local", "mwms", "both"), default="both",
                        help="local: CrossWorker (towers first, then workers; within the "
                             "bound); mwms: WorkerTrainer + AllTowers (MWMS's order: "
                             "bitwise); both (default): train both")
    args = parser.parse_args()

    from towers.cluster import (
        leave_together,
        local_cluster,
        resolve,
        set_logical_devices,
        start_worker,
    )
    from towers.cluster.spec import towers_per_task
    from towers.devices import set_local_task

    if "TF_CONFIG" not in os.environ:  # run alone: a cluster of one worker
        from towers.cluster import tf_config

        os.environ["TF_CONFIG"] = tf_config(local_cluster(1), "worker", 0)
    cluster, towers_n = resolve(), towers_per_task()
    workers, worker = cluster.num_workers, int(cluster.task_index or 0)
    if args.order != "mwms" and args.batch_size % (workers * towers_n):
        parser.error(f"--batch-size must be a multiple of workers × towers = "
                     f"{workers * towers_n} (or use --order mwms)")
    # First thing: the devices and the runtime, before any TensorFlow op.
    if args.no_reference:
        devices = start_worker(cluster, towers_n)
    else:
        set_logical_devices(towers_n)
        strategy = mwms_over_logical_cpus(towers_n)  # starts the runtime, as start_worker would
        # start_worker declares this task's devices as the local ones; here MWMS started
        # the runtime, so say it: /device:CPU:i then means this task's CPU i.
        set_local_task(cluster.task_type, worker)
        devices = [f"/device:CPU:{i}" for i in range(towers_n)]
    run(args, devices, workers, worker, None if args.no_reference else strategy)
    leave_together(cluster)  # a peer may still be pulling this worker's last buffer


def make_trainers(args, devices, workers: int) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """``order -> trainer``: ``local`` (CrossWorker), ``mwms`` (WorkerTrainer + AllTowers)."""
    import keras

    import towers
    from towers.cluster.cross_worker import CrossWorker, WorkerTrainer

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    sgd = lambda: keras.optimizers.SGD(args.lr)  # noqa: E731
    trainers = {}
    if args.order in ("local", "both"):  # each worker's mean, then the mean over workers
        trainers["local"] = towers.TowerTrainer(make_model, sgd, loss, devices=devices,
                                                all_reduce=CrossWorker(workers),
                                                variables="replicated")
    if args.order in ("mwms", "both"):  # losses over the global batch, MWMS's summation order
        trainers["mwms"] = WorkerTrainer(make_model, sgd, loss, devices=devices,
                                         num_workers=workers)
    return trainers


def run(args, devices, workers: int, worker: int, strategy) -> None:  # type: ignore[no-untyped-def]
    """Train both, print each step's losses and the weight difference with its bound."""
    import numpy as np

    from towers.allreduce import as_written
    from towers.cluster.cross_worker import worker_slice
    from towers.split import shard_sizes
    from towers.training.data import batches, digits

    towers_n = len(devices)
    x, y, _, _ = digits()
    trainers = make_trainers(args, devices, workers)
    ref = None if strategy is None else MWMSTrainer(strategy, args.lr, worker, towers_n)
    bound = 0.0
    depths = ((towers_n - 1) + (workers - 1), workers * towers_n - 1)
    for step, (xb, yb) in enumerate(batches(x, y, args.batch_size, seed=0)):
        if step == args.steps:
            break
        part = worker_slice(len(xb), workers, worker)
        xl, yl = xb[part], yb[part]
        with as_written():  # as the reference below: the towers' kernels follow the caller
            losses = {order: float(t.train_step(xl, yl)) for order, t in trainers.items()}
        line = f"step {step}: worker batch {len(xl)}" + "".join(
            f"  towers {'local' if k == 'local' else 'MWMS-order'} loss {v:.7f}"
            for k, v in losses.items())
        if ref is not None:
            tcut = np.cumsum([0, *shard_sizes(len(xl), towers_n)])
            shards = [(xl[a:b], yl[a:b]) for a, b in itertools.pairwise(tcut)]
            with as_written():
                ref_loss, magnitudes = ref.train_step(shards, len(xb))
            largest_w = max(float(np.max(np.abs(w))) for w in ref.model.get_weights())
            step_bound = (args.lr * (gamma(depths[0]) + gamma(depths[1]))
                          * max(float(np.max(m)) for m in magnitudes) + 2 * 2.0**-23 * largest_w)
            bound = 2 * bound + step_bound
            line += f"  MWMS global loss {float(ref_loss):.7f}"
        print(line, flush=True)
    if ref is not None:
        report(trainers, ref, bound)


def report(trainers, ref, bound: float) -> None:  # type: ignore[no-untyped-def]
    """Each trainer's largest weight difference to MWMS, and whether it is bitwise zero."""
    import numpy as np

    for order, trainer in trainers.items():
        pairs = list(zip(trainer.get_weights(), ref.model.get_weights(), strict=True))
        diff = max(float(np.max(np.abs(a - b))) for a, b in pairs)
        same = all(np.array_equal(a, b) for a, b in pairs)
        if order == "local":
            print(f"max |towers - MultiWorkerMirroredStrategy| = {diff:.3e}  (bound {bound:.3e})",
                  flush=True)
        print(f"order {order}: max |towers - MWMS| = {diff:.3e}; bitwise equal: {same}",
              flush=True)


if __name__ == "__main__":
    main()
