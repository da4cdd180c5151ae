"""Worker 0 of a 2-worker cluster whose worker 1 never starts: CrossWorker must time out.

Run as its own process (it starts the distributed runtime); prints ``ERROR <type> <seconds>``.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    """Start worker 0 alone and try one step."""
    from towers.cluster import local_cluster, start_worker, tf_config

    os.environ["TF_CONFIG"] = tf_config(local_cluster(2), "worker", 0)
    devices = start_worker(towers=2)

    import keras
    import numpy as np

    import towers
    from towers.cluster.cross_worker import CrossWorker

    trainer = towers.TowerTrainer(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
        keras.optimizers.SGD(0.1), "mse", devices=devices,
        all_reduce=CrossWorker(2, timeout_seconds=3), variables="replicated")
    start = time.monotonic()
    try:
        trainer.train_step(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"))
        print("NO ERROR", flush=True)
    except Exception as err:
        print(f"ERROR {type(err).__name__} {time.monotonic() - start:.1f}", flush=True)


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the runtime's teardown, which would wait for the missing peer
