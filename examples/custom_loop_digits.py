"""A custom training loop over 4 simulated towers: digits with ``TowerTrainer.train_step``.

What it teaches: the loop ``model.fit`` hides, written out. Each call to
``trainer.train_step(x, y)`` is one synchronous data-parallel step: the batch is split
over the towers (64 = 16+16+16+16; the epoch's last batch of 30 = 8+8+8+6), every tower
runs forward and backward on its shard, a ring all-reduce sums the gradients, and every
replica applies the same update. It returns the *global* mean loss of the batch, so the
epoch's loss is those means weighted by batch size, not their plain average. Then:
how many bytes one step sent per tower (the ring's 2(n-1)/n of the gradients), test
accuracy from replica 0's model (``trainer.model.predict``: every replica holds the same
weights; ``towers.TowerModel`` is the Keras face that splits predict over the towers too),
and a checkpoint that a fresh trainer restores bit for bit — what you need to resume a
long run.

Run: python examples/custom_loop_digits.py [--epochs 3]
"""

from __future__ import annotations

import argparse
import tempfile

import towers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    args = parser.parse_args()
    devices = towers.simulate_devices(args.towers)  # first thing: before TensorFlow starts
    import keras
    import numpy as np

    from towers.training import checkpoint
    from towers.training.data import batches, digits
    from towers.training.models import digits_cnn

    x, y, x_test, y_test = digits()

    def make_trainer() -> towers.TowerTrainer:
        return towers.TowerTrainer(
            lambda: digits_cnn(seed=0),
            lambda: keras.optimizers.Adam(3e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            devices=devices,
            all_reduce="ring",
            variables="replicated",
        )

    trainer = make_trainer()
    for epoch in range(args.epochs):
        total, seen = 0.0, 0
        for xb, yb in batches(x, y, batch_size=64, seed=epoch):  # reshuffled every epoch
            loss = float(trainer.train_step(xb, yb))  # global mean over the batch
            total, seen = total + loss * len(xb), seen + len(xb)
        logits = trainer.model.predict(x_test, batch_size=256, verbose=0)
        accuracy = np.mean(np.argmax(logits, axis=1) == y_test)
        mean = total / seen
        print(f"epoch {epoch + 1}/{args.epochs}  loss {mean:.4f}  test accuracy {accuracy:.4f}")

    stats = trainer.last_step_stats  # counted where the step was traced
    assert stats is not None
    size = sum(int(np.prod(v.shape)) * 4 for v in trainer.model.trainable_variables)
    n = len(devices)
    sent = [stats.bytes_per_tower.get(d, 0) for d in devices]
    print(f"one step: {size} bytes of gradients; each tower sent {sent}")
    print(f"  (a ring sends 2(n-1)/n of them: {2 * (n - 1) * size // n}, plus padding and loss)")

    with tempfile.TemporaryDirectory() as tmp:
        prefix = checkpoint.save(trainer, f"{tmp}/ckpt")
        fresh = make_trainer()
        checkpoint.restore(fresh, prefix)
        same = all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), trainer.get_weights()))
        print(f"restored at step {int(fresh.optimizer.iterations)}: bitwise equal {same}")


if __name__ == "__main__":
    main()
