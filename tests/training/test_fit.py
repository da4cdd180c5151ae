"""towers.training.fit: fit / evaluate / predict against model.fit, callbacks, exact metrics."""

from __future__ import annotations

import csv
import glob
import math
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce.machinery.ordering import as_written
from towers.split import shard_sizes
from towers.testing import assert_weights_close, gamma
from towers.training import checkpoint
from towers.training.data import digits
from towers.training.inference import inference
from towers.training.models import digits_cnn

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
X, Y, X_TEST, Y_TEST = digits()
BATCH = 64
FULL_BATCHES = len(X) // BATCH  # 22 batches of 64, then one of 1438 - 1408 = 30


def _tiny(n: int = 2, **kwargs: Any) -> towers.TowerTrainer:
    """A fast trainer: a linear classifier on the 8×8 digits."""

    def make() -> keras.Model:
        inp = keras.Input((8, 8, 1))
        out = keras.layers.Dense(10, kernel_initializer=keras.initializers.GlorotUniform(0))(
            keras.layers.Flatten()(inp)
        )
        return keras.Model(inp, out)

    kwargs.setdefault("variables", "replicated")
    return towers.TowerTrainer(
        make,
        lambda: keras.optimizers.Adam(1e-2),
        LOSS,
        devices=DEVICES[:n],
        all_reduce="naive",
        **kwargs,
    )


class _Snapshot(keras.callbacks.Callback):
    """Keeps ``model.get_weights()`` after batch ``at`` and runs ``then()`` there."""

    def __init__(self, at: int, then: Any = None) -> None:
        super().__init__()
        self.at, self.then, self.weights = at, then, None

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch == self.at:
            self.weights = self.model.get_weights()
            if self.then is not None:
                self.then()


# -- equivalence with Keras' model.fit under MirroredStrategy ----------------------------------


@pytest.fixture(scope="module")
def towers_epoch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One epoch of ``trainer.fit`` on digits (4 towers, Adam, batch 64, no shuffling),
    plus the last step replayed with the per-example weights Keras applies (see below)."""
    trainer = towers.TowerTrainer(
        lambda: digits_cnn(0),
        lambda: keras.optimizers.Adam(1e-3),
        LOSS,
        devices=DEVICES[:4],
        all_reduce="naive",
        variables="replicated",
    )
    initial = trainer.get_weights()
    prefix = str(tmp_path_factory.mktemp("fit") / "before_last")
    snap = _Snapshot(FULL_BATCHES - 1, then=lambda: checkpoint.save(trainer, prefix))
    history = trainer.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[snap])
    final = trainer.get_weights()
    # Replay the last, uneven batch (30 = 8+8+8+6) with the weights model.fit gives each
    # example: replica r's mean loss times 1/n, i.e. w = B / (n * B_r) per example.
    checkpoint.restore(trainer, prefix)
    x, y = X[FULL_BATCHES * BATCH :], Y[FULL_BATCHES * BATCH :]
    sizes = [s for s in shard_sizes(len(x), 4) if s]
    weights = np.concatenate([np.full(s, len(x) / (4 * s), "float32") for s in sizes])
    trainer.train_step(x, y, weights)
    return {
        "initial": initial,
        "snapshot": snap.weights,
        "final": final,
        "keras_weighted": trainer.get_weights(),
        "loss": history.history["loss"],
    }


def _adam_step_bound(t: int, lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999) -> float:
    """The most one Adam step ``t`` can move a weight, for any gradients.

    Keras' Adam moves ``alpha_t·m/(√v+ε)`` with ``alpha_t = lr·√(1−b2^t)/(1−b1^t)``,
    ``m = (1−b1)·Σ_j b1^j g_{t−j}`` and ``v = (1−b2)·Σ_j b2^j g_{t−j}²``. By Cauchy–Schwarz,
    ``|m| ≤ (1−b1)·√(Σ_j (b1²/b2)^j)·√(v/(1−b2))``, so ``|m|/√v ≤ (1−b1)/√(1−b2)·√S_t``.
    """
    s = sum((b1 * b1 / b2) ** j for j in range(t))
    alpha = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
    return alpha * (1 - b1) / math.sqrt(1 - b2) * math.sqrt(s)


@pytest.mark.parametrize("ordering", ["default", "as_written"])
def test_fit_equals_keras_model_fit_under_mirrored_strategy(
    towers_epoch: dict[str, Any], ordering: str
) -> None:
    strategy = tf.distribute.MirroredStrategy(
        DEVICES[:4], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        model = digits_cnn(0)
        model.set_weights(towers_epoch["initial"])
        model.compile(keras.optimizers.Adam(1e-3), LOSS)
    snap = _Snapshot(FULL_BATCHES - 1)
    if ordering == "as_written":
        with as_written():
            history = model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[snap])
    else:
        history = model.fit(X, Y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[snap])

    # 1. The 22 full batches (16 examples per tower): bitwise equal, with or without
    #    Grappler. Keras scales each replica's mean by 1/n — (Σl/16)·(1/4) — and towers
    #    divides by the global batch — Σl/64 —: with powers of two both are exact.
    assert_weights_close(towers_epoch["snapshot"], snap.weights, what="after 22 batches")

    # 2. The last batch, 30 examples as 8+8+8+6, is where they part: model.fit minimizes the
    #    mean of the replicas' means (an example in the short shard weighs 1/24, the others
    #    1/32) while towers minimizes the global mean (1/30 each). With those weights given
    #    to towers as sample weights, the results are bitwise equal again …
    assert_weights_close(towers_epoch["keras_weighted"], model.get_weights(), what="weighted")

    # 3. … so the whole difference is one Adam step taken from the same state with different
    #    gradients: at most twice the largest move A of step 23 (measured: 7.9e-4 < 2.4e-3).
    #    A holds in exact arithmetic; in float32 each run's move carries the relative error
    #    of its m and v recursions (≤ 4 roundings per step over t steps: g², g − m, ×(1 − b),
    #    +) and of α_t, √v, + ε, ÷, × (6 more): γ_{4t+6}; storing w − move rounds once more,
    #    by at most u·|w'| per run.
    t = FULL_BATCHES + 1
    largest = max(float(np.max(np.abs(w))) for w in model.get_weights())
    u = float(np.finfo(np.float32).eps) / 2
    bound = 2 * _adam_step_bound(t) * (1 + gamma(4 * t + 6)) + 2 * u * largest
    diff = max(
        float(np.max(np.abs(a - b))) for a, b in zip(towers_epoch["final"], model.get_weights())
    )
    assert 0 < diff <= bound

    # 4. The reported epoch loss is the example-weighted mean in both: Keras accumulates its
    #    float32 total over 23 batches x 4 replicas, towers in float64 from the same losses.
    ours, theirs = towers_epoch["loss"][0], history.history["loss"][0]
    assert abs(ours - theirs) <= gamma(2 * (FULL_BATCHES + 1) + 4) * abs(theirs)


# -- exact metrics, predict and evaluate over towers -------------------------------------------


def test_evaluate_aggregates_exactly_over_uneven_and_empty_towers() -> None:
    trainer = _tiny(4)
    trainer.fit(X[:256], Y[:256], batch_size=64, verbose=0, seed=1)
    x, y = X_TEST[:99], Y_TEST[:99]  # batches of 10 split 3,3,3,1; the last, 9, as 3,3,3,0
    xent = keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")
    got = trainer.evaluate(x, y, batch_size=10, metrics=["accuracy", xent], return_dict=True)
    logits = trainer.predict(x, batch_size=10)
    per_example = LOSS.call(y, logits).numpy().astype(np.float64)
    assert got["loss"] == pytest.approx(per_example.mean(), rel=1e-6)
    # Accuracy is a count of correct examples divided once by their number, not a mean of
    # the towers' accuracies (the 1-example tower would weigh as much as a 3-example one).
    correct = int(np.sum(np.argmax(logits, axis=1) == y))
    assert got["accuracy"] == np.float32(correct) / np.float32(len(y))
    # Every Keras metric sees the towers' outputs concatenated in tower order: the same
    # result as Keras' own metric on those outputs, whatever the number of towers.
    # A float-sum state (Σ cross-entropy), updated once per batch as on one device:
    for start in range(0, len(y), 10):
        xent.update_state(y[start : start + 10], logits[start : start + 10])
    assert got["xent"] == float(xent.result())
    assert trainer.evaluate(x, y, batch_size=10) == got["loss"]
    loss, acc = trainer.evaluate(x, y, batch_size=10, metrics=["accuracy"])  # type: ignore[misc]
    assert (loss, acc) == (got["loss"], got["accuracy"])


def test_predict_splits_over_towers_in_tower_order_with_one_trace() -> None:
    trainer = _tiny(4, variables="parameter_device")
    x = X_TEST[:10]
    got = trainer.predict(x, batch_size=3)  # 3,3,3,1 examples: shards 1,1,1,0 and 1,0,0,0
    np.testing.assert_allclose(got, trainer.model(x, training=False), rtol=1e-6, atol=1e-6)
    fn = inference(trainer).outputs
    traces = fn.experimental_get_tracing_count()
    again = trainer.predict(tf.data.Dataset.from_tensor_slices((x, Y_TEST[:10])).batch(3))
    np.testing.assert_array_equal(again, got)
    assert fn.experimental_get_tracing_count() == traces  # same shapes: no retrace


def test_fit_accepts_a_dataset_with_sample_weights_like_arrays() -> None:
    x, y = X[:200], Y[:200]
    w = np.linspace(0.0, 2.0, len(x)).astype("float32")
    a, b = _tiny(3), _tiny(3)
    ha = a.fit(x, y, sample_weight=w, batch_size=50, epochs=2, shuffle=False, verbose=0)
    data = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(50)
    hb = b.fit(data, epochs=2, verbose=0)
    assert_weights_close(a.get_weights(), b.get_weights(), what="dataset vs arrays")
    assert ha.history["loss"] == hb.history["loss"]
    assert ha.epoch == [0, 1]


def test_progress_bar_and_validation_logs(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = _tiny(2)
    history = trainer.fit(
        X[:128],
        Y[:128],
        batch_size=64,
        epochs=2,
        validation_data=(X_TEST[:64], Y_TEST[:64]),
        metrics=["accuracy"],
        seed=0,
    )
    out = capsys.readouterr().out
    assert "Epoch 2/2" in out and "2/2" in out and "val_accuracy" in out
    assert set(history.history) == {"loss", "accuracy", "skipped", "val_loss", "val_accuracy"}
    assert history.history["val_loss"][-1] == pytest.approx(
        trainer.evaluate(X_TEST[:64], Y_TEST[:64], batch_size=64), rel=0, abs=0
    )


# -- Keras callbacks -----------------------------------------------------------------------------


def test_model_checkpoint_saves_the_best_weights(tmp_path: Path) -> None:
    trainer = _tiny(2)
    path = str(tmp_path / "best.weights.h5")
    kept: list[list[np.ndarray]] = []
    cbs = [
        keras.callbacks.ModelCheckpoint(
            path, monitor="val_loss", save_best_only=True, save_weights_only=True
        ),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda e, logs: kept.append(trainer.get_weights())
        ),
    ]
    history = trainer.fit(
        X[:128],
        Y[:128],
        batch_size=64,
        epochs=3,
        verbose=0,
        seed=0,
        validation_data=(X_TEST[:64], Y_TEST[:64]),
        callbacks=cbs,
    )
    best = int(np.argmin(history.history["val_loss"]))
    fresh = _tiny(1).model
    fresh.load_weights(path)
    assert_weights_close(fresh.get_weights(), kept[best], what="checkpointed")


def test_early_stopping_stops_and_restores_every_replica() -> None:
    trainer = _tiny(3)
    after_first: list[list[np.ndarray]] = []
    cbs = [
        # min_delta so large that no epoch after the first counts as an improvement.
        keras.callbacks.EarlyStopping(
            monitor="loss", min_delta=100.0, patience=0, restore_best_weights=True
        ),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda e, logs: (
                after_first.append(trainer.get_weights()) if e == 0 else None
            )
        ),
    ]
    history = trainer.fit(X[:96], Y[:96], batch_size=32, epochs=10, verbose=0, callbacks=cbs)
    assert history.epoch == [0, 1]  # stopped by model.stop_training after the second epoch
    for replica in trainer.replica_weights():  # restored on trainer.model, copied to all
        assert_weights_close(replica, after_first[0], what="restored")


def test_csv_logger_writes_one_row_per_epoch(tmp_path: Path) -> None:
    trainer = _tiny(2)
    path = tmp_path / "log.csv"
    history = trainer.fit(
        X[:128],
        Y[:128],
        batch_size=64,
        epochs=3,
        verbose=0,
        validation_data=(X_TEST[:64], Y_TEST[:64]),
        metrics=["accuracy"],
        callbacks=[keras.callbacks.CSVLogger(str(path))],
    )
    rows = list(csv.DictReader(path.open()))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"epoch", "loss", "accuracy", "skipped", "val_loss", "val_accuracy"}
    for key in ("loss", "val_accuracy"):
        np.testing.assert_allclose([float(r[key]) for r in rows], history.history[key], rtol=1e-6)


def _scalars(directory: Path) -> dict[str, list[float]]:
    """Every numeric scalar in the TensorBoard event files of ``directory``, by tag."""
    found: dict[str, list[float]] = {}
    for name in glob.glob(str(directory / "events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(name):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                array = tf.make_ndarray(value.tensor)
                if array.dtype.kind == "f":
                    found.setdefault(value.tag, []).append(float(array))
    return found


def test_tensorboard_logs_epoch_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tf.summary needs the tensorboard package")
    trainer = _tiny(2)
    history = trainer.fit(
        X[:128],
        Y[:128],
        batch_size=64,
        epochs=2,
        verbose=0,
        validation_data=(X_TEST[:64], Y_TEST[:64]),
        callbacks=[keras.callbacks.TensorBoard(str(tmp_path))],
    )
    train, val = _scalars(tmp_path / "train"), _scalars(tmp_path / "validation")
    np.testing.assert_allclose(train["epoch_loss"], history.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(val["epoch_loss"], history.history["val_loss"], rtol=1e-6)


# -- bad input -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> towers.TowerTrainer:
    return _tiny(2)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda t: t.fit(X[:8]), "y"),
        (lambda t: t.fit(X[:8], Y[:8], batch_size=0), "batch_size"),
        (lambda t: t.fit(X[:8], Y[:8], epochs=-1), "epochs"),
        (lambda t: t.fit(X[:8], Y[:7]), "y"),
        (lambda t: t.fit(X[:8], Y[:8], sample_weight=np.ones(3)), "sample_weight"),
        (lambda t: t.fit(X[:8], Y[:8], validation_data=X[:8]), "validation_data"),
        (lambda t: t.fit(tf.data.Dataset.from_tensors((X[:8], Y[:8])), Y[:8]), "y"),
        (lambda t: t.fit(X[:0], Y[:0]), "x"),
        (lambda t: t.evaluate(X[:8], Y[:8], metrics=["no_such_metric"]), "metrics"),
        (lambda t: t.evaluate(X[:8]), "y"),
        (lambda t: t.predict(X[:8], batch_size=-3), "batch_size"),
    ],
)
def test_bad_input_names_the_argument(tiny: towers.TowerTrainer, call: Any, argument: str) -> None:
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        call(tiny)


def test_zero_epochs_train_nothing(tiny: towers.TowerTrainer) -> None:
    before = tiny.get_weights()
    history = tiny.fit(X[:8], Y[:8], epochs=0, verbose=0)
    assert history.history == {}
    assert_weights_close(tiny.get_weights(), before, what="untouched")


def test_fit_counts_skipped_steps_and_leaves_them_out_of_the_loss() -> None:
    # batch 1 of epoch 0 holds a NaN: the guard skips it; the history says so, the epoch's
    # loss averages the other batches, and the weights equal training without that batch.
    x = X[:192].copy()
    x[64 + 5, 0, 0, 0] = np.nan  # batch 1 (rows 64…127), tower 0
    ours = _tiny(2)
    history = ours.fit(x, Y[:192], batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert history.history["skipped"] == [1.0, 1.0]
    assert ours.skipped_steps == 2
    assert all(math.isfinite(v) for v in history.history["loss"])
    clean = _tiny(2)
    for _ in range(2):
        for k in (0, 2):
            clean.train_step(X[64 * k : 64 * (k + 1)], Y[64 * k : 64 * (k + 1)])
    for a, b in zip(ours.get_weights(), clean.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(ours.optimizer.iterations) == 4


def test_fit_reports_no_skips_when_the_guard_is_off() -> None:
    trainer = _tiny(2, on_nonfinite="ignore")
    history = trainer.fit(X[:128], Y[:128], batch_size=64, epochs=1, verbose=0)
    assert "skipped" not in history.history
