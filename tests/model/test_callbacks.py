"""Every callback in ``keras.callbacks`` on a TowerModel: one test per row of docs/keras.md's table.

Each test checks what the callback is for (a file written, training stopped, a value
restored or changed) and that every replica agrees afterwards. The callbacks run on
Keras's own loop, so a row fails only where a write misses the replicas or the logs
differ from Keras's.
"""

from __future__ import annotations

import csv
import http.server
import json
import threading
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES
from tests.model.helpers import N, assert_replicas_equal, data, network, reset, tower_model

X, Y = data(20)
VALIDATION = (X[:10], Y[:10])


@pytest.fixture(scope="module")
def shared() -> tuple[towers.TowerModel, list[np.ndarray]]:
    """One replicated TowerModel (traced once) and its first weights."""
    tm = tower_model("replicated", all_reduce=None)
    return tm, tm.get_weights()


@pytest.fixture
def tm(shared: tuple[towers.TowerModel, list[np.ndarray]]) -> towers.TowerModel:
    reset(*shared)
    return shared[0]


def _fit(tm: towers.TowerModel, callbacks: list[Any], **kwargs: Any) -> keras.callbacks.History:
    kwargs = {"batch_size": 10, "epochs": 3, "shuffle": False, "verbose": 0,
              "validation_data": VALIDATION, **kwargs}
    return tm.fit(X, Y, callbacks=callbacks, **kwargs)


def test_history(tm: towers.TowerModel) -> None:
    history = _fit(tm, [])
    assert tm.history is history and history.epoch == [0, 1, 2]
    assert len(history.history["val_accuracy"]) == 3


def test_backup_and_restore_resumes_exactly(tm: towers.TowerModel, tmp_path: Path) -> None:
    start = tm.get_weights()
    _fit(tm, [])
    straight = tm.get_weights()

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch == 2:
                raise RuntimeError("crash")

    tm.set_weights(start)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tm, [backup, Crash()])
    tm.set_weights([w * 0 for w in start])  # a fresh process would start elsewhere
    history = _fit(tm, [backup])
    assert history.epoch == [2]
    for got, want in zip(tm.get_weights(), straight, strict=True):
        np.testing.assert_array_equal(got, want)
    assert_replicas_equal(tm)


def test_csv_logger(tm: towers.TowerModel, tmp_path: Path) -> None:
    _fit(tm, [keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))])
    rows = list(csv.DictReader((tmp_path / "log.csv").open()))
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(rows[0])


def test_early_stopping_restores_the_best_val_accuracy_weights(tm: towers.TowerModel) -> None:
    seen: list[list[np.ndarray]] = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(
        tm.get_weights()))
    stop = keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=1,
                                         restore_best_weights=True, min_delta=1.0)
    history = _fit(tm, [record, stop], epochs=5)
    assert len(history.epoch) == 2  # nothing improves by 1.0: stops after patience
    for got, want in zip(tm.get_weights(), seen[0], strict=True):
        np.testing.assert_array_equal(got, want)
    assert_replicas_equal(tm)  # and the next step starts from them everywhere
    _fit(tm, [], epochs=1)
    assert_replicas_equal(tm)


def test_lambda_callback(tm: towers.TowerModel) -> None:
    batches: list[float] = []
    _fit(tm, [keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: batches.append(float(logs["loss"])))])
    assert len(batches) == 6 and all(np.isfinite(batches))


def test_learning_rate_scheduler(tm: towers.TowerModel) -> None:
    history = _fit(tm, [keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))])
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert tm.trainer is not None
    assert all(float(r.optimizer.learning_rate) == pytest.approx(0.1 / 3)
               for r in tm.trainer.replicas)


@pytest.mark.parametrize("weights_only", [True, False], ids=["weights", "model"])
def test_model_checkpoint(tm: towers.TowerModel, tmp_path: Path, weights_only: bool) -> None:
    path = str(tmp_path / ("best.weights.h5" if weights_only else "best.keras"))
    _fit(tm, [keras.callbacks.ModelCheckpoint(path, monitor="val_accuracy",
                                              save_best_only=True, save_weights_only=weights_only)])
    final = tm.get_weights()
    if weights_only:
        tm.load_weights(path)
    else:
        loaded = keras.models.load_model(path)
        assert isinstance(loaded, towers.TowerModel)
        tm.set_weights(loaded.get_weights())
    assert_replicas_equal(tm)
    assert len(tm.get_weights()) == len(final)


def test_progbar_logger(tm: towers.TowerModel, capsys: pytest.CaptureFixture[str]) -> None:
    _fit(tm, [], epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "2/2" in out and "loss:" in out and "val_accuracy:" in out


def test_reduce_lr_on_plateau(tm: towers.TowerModel) -> None:
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                min_delta=10.0)
    _fit(tm, [plateau], epochs=3)  # epoch 0 improves on inf; 1 and 2 halve the rate
    tm.train_on_batch(X[:10], Y[:10])  # the last halving reaches the replicas by the next step
    assert tm.trainer is not None
    rates = [float(r.optimizer.learning_rate) for r in tm.trainer.replicas]
    assert rates == [np.float32(0.025)] * 3


def test_remote_monitor(tm: towers.TowerModel) -> None:
    posted: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"])).decode()
            posted.append(json.loads(dict(p.split("=", 1) for p in body.split("&"))["data"]
                                     .replace("%22", '"').replace("%3A", ":")
                                     .replace("%2C", ",").replace("+", " ").replace("%7B", "{")
                                     .replace("%7D", "}")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        _fit(tm, [keras.callbacks.RemoteMonitor(f"http://127.0.0.1:{server.server_port}")])
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert [p["epoch"] for p in posted] == [0, 1, 2]
    assert "val_loss" in posted[0]


def test_tensorboard(tm: towers.TowerModel, tmp_path: Path) -> None:
    _fit(tm, [keras.callbacks.TensorBoard(str(tmp_path))], epochs=1)
    assert list((tmp_path / "train").glob("events.out.tfevents.*"))
    assert list((tmp_path / "validation").glob("events.out.tfevents.*"))


def test_terminate_on_nan(tm: towers.TowerModel) -> None:
    start = tm.get_weights()
    weights = np.ones(20, "f4")
    weights[3] = np.nan  # (a NaN in x may vanish in a ReLU: max(NaN, 0) is 0 on oneDNN)
    history = tm.fit(X, Y, sample_weight=weights, batch_size=10, epochs=3, shuffle=False,
                     verbose=0, callbacks=[keras.callbacks.TerminateOnNaN()])
    assert history.epoch == [0]  # the first batch's loss is NaN: stopped there
    assert tm.trainer is not None and tm.trainer.skipped_steps >= 1  # and it changed nothing
    for got, want in zip(tm.get_weights(), start, strict=True):
        np.testing.assert_array_equal(got, want)


def test_swap_ema_weights() -> None:
    tm = tower_model("replicated", all_reduce=None,
                     optimizer=keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5))
    averages: list[list[np.ndarray]] = []
    keep = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: averages.append(
        [v.numpy() for v in tm.optimizer._model_variables_moving_average]))
    history = _fit(tm, [keras.callbacks.SwapEMAWeights(), keep], epochs=2)
    tm.set_weights(averages[-1])  # validation ran on the EMA weights, on every tower
    assert tm.evaluate(*VALIDATION, verbose=0)[0] == history.history["val_loss"][-1]
    assert_replicas_equal(tm)


@pytest.mark.parametrize("variables", ["replicated", "parameter_device"])
def test_swap_ema_weights_on_epoch_swaps_back_on_every_replica(variables: str) -> None:
    """Keras calls reset_metrics (where TowerModel broadcasts replica 0) *before*
    on_epoch_begin, where SwapEMAWeights(swap_on_epoch=True) swaps the trained weights
    back; the other replicas must get them before the epoch's first step, not train it
    from the moving averages (which moved the weights by 1.7e-2 from one device's)."""

    def fitted(model: keras.Model) -> keras.Model:
        model.compile(keras.optimizers.SGD(0.5, use_ema=True, ema_momentum=0.5),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(X[:12], Y[:12], batch_size=6, epochs=3, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)])
        return model

    one = fitted(network(3))
    tm = fitted(towers.TowerModel(network(3), devices=DEVICES[:N], variables=variables))
    tm.predict(X[:3], verbose=0)  # the last epoch_end swap (replica 0) reaches every replica
    assert_replicas_equal(tm)
    # one device sums each batch of 6 in one kernel, three towers in shards of 2 and an
    # all-reduce: a few ULPs per step apart, four orders of magnitude below the bug's
    for got, want in zip(tm.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
