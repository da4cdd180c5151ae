"""``trainer.fit`` on digits over 4 simulated towers: the Keras loop, data-parallel.

What it teaches: you do not need to write the loop. ``trainer.fit`` runs
``TowerTrainer.train_step`` batch after batch with Keras' progress bar, its
``History`` and its callbacks — here ``EarlyStopping`` (it sets
``model.stop_training``; ``restore_best_weights`` is copied to every replica) and
``CSVLogger`` — and checks the validation data after every epoch. Loss and accuracy
are aggregated exactly across towers: each tower's loss *sum* and the batch's outputs
(concatenated in tower order) are combined and divided once, so a short last shard
does not count as much as a full one. ``evaluate`` and ``predict`` split every batch
over the towers too, in one compiled forward pass without a tape.

Run: python examples/fit_digits.py [--epochs 20]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import towers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20, help="most epochs (default 20)")
    args = parser.parse_args()
    devices = towers.simulate_devices(args.towers)  # first thing: before TensorFlow starts
    import keras
    import numpy as np

    from towers.training.data import digits
    from towers.training.models import digits_cnn

    x, y, x_test, y_test = digits()
    x_train, y_train, x_val, y_val = x[:1150], y[:1150], x[1150:], y[1150:]
    trainer = towers.TowerTrainer(
        lambda: digits_cnn(seed=0),
        lambda: keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=devices,
        all_reduce="naive",
        variables="replicated",
    )
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "training.csv"
        callbacks = [
            keras.callbacks.EarlyStopping(
                monitor="val_loss", patience=2, restore_best_weights=True, verbose=1
            ),
            keras.callbacks.CSVLogger(str(log)),
        ]
        history = trainer.fit(
            x_train,
            y_train,
            batch_size=64,
            epochs=args.epochs,
            validation_data=(x_val, y_val),
            metrics=["accuracy"],
            callbacks=callbacks,
            seed=0,
            verbose=2,  # one line per epoch; 1 draws a live progress bar
        )
        print(f"CSVLogger wrote {len(log.read_text().splitlines()) - 1} epochs to {log.name}")
    print(
        f"trained {len(history.epoch)} epochs; best val_loss {min(history.history['val_loss']):.4f}"
    )

    loss, accuracy = trainer.evaluate(x_test, y_test, batch_size=128, metrics=["accuracy"])
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    predicted = np.argmax(trainer.predict(x_test[:12]), axis=1)
    print(f"predicted {predicted.tolist()}")
    print(f"labels    {y_test[:12].tolist()}")


if __name__ == "__main__":
    main()
