"""``TowerModel`` on digits over 4 simulated towers: Keras's ``compile``/``fit``, data-parallel.

What it teaches: you do not need to write the loop, nor leave Keras. ``towers.TowerModel``
is a ``keras.Model`` whose ``fit`` runs the towers step (``tm.trainer.train_step``) batch
after batch inside Keras's own loop: its data adapters, progress bar, ``History`` and
callbacks — here ``EarlyStopping`` (``restore_best_weights`` reaches every replica) and
``CSVLogger`` — and the validation data after every epoch. The loss Keras reports is the
step's global mean loss; the metrics see the step's own outputs, concatenated in tower
order. ``evaluate`` and ``predict`` split every batch over the towers too, in one
compiled forward pass without a tape.

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
    keras.utils.set_random_seed(0)  # Keras shuffles the training data each epoch
    tm = towers.TowerModel(digits_cnn(seed=0), devices=devices, all_reduce="naive",
                           variables="replicated")  # fmt: skip
    tm.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "training.csv"
        callbacks = [
            keras.callbacks.EarlyStopping(
                monitor="val_loss", patience=2, restore_best_weights=True, verbose=1
            ),
            keras.callbacks.CSVLogger(str(log)),
        ]
        history = tm.fit(
            x_train,
            y_train,
            batch_size=64,
            epochs=args.epochs,
            validation_data=(x_val, y_val),
            callbacks=callbacks,
            verbose=2,  # one line per epoch; 1 draws a live progress bar
        )
        print(f"CSVLogger wrote {len(log.read_text().splitlines()) - 1} epochs to {log.name}")
    print(
        f"trained {len(history.epoch)} epochs; best val_loss {min(history.history['val_loss']):.4f}"
    )

    loss, accuracy = tm.evaluate(x_test, y_test, batch_size=128, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")
    predicted = np.argmax(tm.predict(x_test[:12], verbose=0), axis=1)
    print(f"predicted {predicted.tolist()}")
    print(f"labels    {y_test[:12].tolist()}")


if __name__ == "__main__":
    main()
