"""The bad-input matrix: every mistake gets a clear error naming what was wrong.

Each row is (input, error type, message fragment); docs/bad_inputs.md shows the same
table to users (``python -m tests.test_bad_inputs`` prints it; a test keeps the two in
step). A row that reaches a trainer also checks that nothing changed: no error leaves
a variable half-updated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES, replica_bytes
from towers.cluster import AllTowers, AsyncTrainer, WorkerTrainer
from towers.guard.errors import AlgorithmError
from towers.split import distribute
from towers.training import checkpoint
from towers.training.backup import ExactResume

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dense() -> keras.Model:
    inp = keras.Input((5,))
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer="ones")(inp))


def _dict_model() -> keras.Model:
    inp = {"a": keras.Input((3,), name="a"), "b": keras.Input((2,), name="b")}
    h = keras.layers.Concatenate()([inp["a"], inp["b"]])
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer="ones")(h))


def _two_inputs() -> keras.Model:
    a, b = keras.Input((3,)), keras.Input((2,))
    h = keras.layers.Concatenate()([a, b])
    return keras.Model([a, b], keras.layers.Dense(3, kernel_initializer="ones")(h))


def _two_outputs() -> keras.Model:
    inp = keras.Input((5,))
    return keras.Model(inp, [keras.layers.Dense(3, kernel_initializer="ones", name="a")(inp),
                             keras.layers.Dense(3, kernel_initializer="ones", name="b")(inp)])


class _OwnStep(keras.Model):
    """A Keras habit: a model whose train_step (and compute_loss) is its own."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def train_step(self, data: Any) -> Any:  # pragma: no cover - refused before it runs
        return super().train_step(data)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover
        return super().compute_loss(*args, **kwargs)


def _own_step() -> keras.Model:
    model = _OwnStep()
    model(X)
    return model


_DENOMINATOR = r"loss_denominator must be None \(the semantics' divisor\), 'global' or a positive"


def _new(model: Any = _dense, optimizer: Any = None, loss: Any = LOSS, **kw: Any) -> Any:
    optimizer = optimizer if optimizer is not None else (lambda: keras.optimizers.Adam(0.1))
    kw.setdefault("devices", DEVICES[:2])
    return towers.TowerTrainer(model, optimizer, loss, **kw)


@functools.cache
def _trainer(kind: str) -> towers.TowerTrainer:
    model = {"dense": _dense, "dict": _dict_model, "two": _two_inputs}[kind]
    return _new(model, variables="replicated", all_reduce="naive")


X = np.ones([8, 5], "float32")
Y = np.zeros([8], "int32")


def _step(x: Any = X, y: Any = Y, w: Any = None, kind: str = "dense") -> Any:
    return _trainer(kind).train_step(x, y, w)


def _fit_shuffled() -> Any:
    """TowerModel.fit with Keras's default shuffle=True and an ExactResume (refused)."""
    tm = towers.TowerModel(_dense(), devices=DEVICES[:2], variables="replicated")
    tm.compile(keras.optimizers.Adam(0.1), LOSS)
    return tm.fit(X, Y, verbose=0, callbacks=[ExactResume("unused")])


def _too_few(values: Any, *, op: str = "sum") -> list[tf.Tensor]:
    return [tf.identity(values[0])]


def _one_device(values: Any, *, op: str = "sum") -> list[tf.Tensor]:
    with tf.device(DEVICES[0]):
        total = tf.add_n(list(values))
        return [tf.identity(total) for _ in values]


def _shared_reducer() -> Any:
    """One compressed reducer (error feedback) handed to two trainers."""
    reducer = towers.compressed("ring", "topk(0.5)")
    first = _new(all_reduce=reducer)
    return _new(all_reduce=reducer), first


def _hangs_at_construction() -> None:
    """``TowerTrainer(all_reduce=<waits on a queue>, step_timeout=2)``, in a fresh process:
    the deadline's expiry aborts the process's collective ops."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tests.guard.test_construction_deadline",
                           "queue", "2"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    error = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    kind, _, message = error.partition(": ")
    raise {"TimeoutError": TimeoutError}.get(kind, RuntimeError)(message)


def _gen() -> Any:
    yield X


class Case(NamedTuple):
    id: str
    input: str  # what the user did, for the docs
    call: Callable[[], Any]
    error: type
    fragment: str  # a regular expression the message must contain
    pending: str = ""  # not yet so: the row is a strict xfail, and the docs say so


def _saved(tmp: str, optimizer: Callable[[], Any], **kw: Any) -> str:
    """A checkpoint of a fresh ``_dense`` trainer built with ``optimizer`` and ``kw``."""
    kw.setdefault("variables", "replicated")
    prefix = str(Path(tmp) / "ckpt")
    checkpoint.save(_new(_dense, optimizer, **kw), prefix)
    return prefix


def _restore_into(optimizer: Callable[[], Any], **kw: Any) -> Any:
    """Save an SGD(momentum=0.9) replicated trainer, restore it into another one."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        prefix = _saved(tmp, lambda: keras.optimizers.SGD(0.1, momentum=0.9))
        kw.setdefault("variables", "replicated")
        return checkpoint.restore(_new(_dense, optimizer, **kw), prefix)


def _dense_async(**kw: Any) -> Any:
    return AsyncTrainer(_dense, LOSS, workers=[DEVICES[:1]], ps_devices=DEVICES[1:2], **kw)


def _embedding() -> keras.Model:
    inp = keras.Input((2,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(4, 2)(inp))
    return keras.Model(inp, keras.layers.Dense(3)(h))


def _synced_norm() -> keras.Model:
    inp = keras.Input((5,))
    h = keras.layers.BatchNormalization(synchronized=True, name="synced")(inp)
    return keras.Model(inp, keras.layers.Dense(3)(h))


C = Case
CASES: list[Case] = [
    # -- TowerTrainer(model, optimizer, loss, ...) -------------------------------------------
    C("model-none", "model=None", lambda: _new(None), TypeError,
      "model must be a keras.Model or a factory"),
    C("model-layer", "a Layer as the model", lambda: _new(keras.layers.Dense(3)), TypeError,
      r"got a keras Layer \(Dense\): wrap it"),
    C("model-string", "model='mlp'", lambda: _new("mlp"), TypeError,
      "model must be a keras.Model or a factory"),
    C("model-factory-layer", "a model factory returning a Layer",
      lambda: _new(lambda: keras.layers.Dense(3)), TypeError,
      "model factory must return a keras.Model"),
    C("model-unbuilt", "an unbuilt Sequential", lambda: _new(keras.Sequential([
        keras.layers.Dense(3)])), ValueError, "model is not built"),
    C("model-is-optimizer", "an optimizer as the model", lambda: _new(keras.optimizers.SGD()),
      TypeError, r"got a Keras optimizer \(SGD\)"),
    C("model-frozen", "a model with no trainable variables",
      lambda: _new(lambda: keras.Sequential([keras.Input((5,)), keras.layers.Dense(
          3, trainable=False)])), ValueError, "no trainable variables"),
    C("optimizer-none", "optimizer=None", lambda: _new(optimizer=False), TypeError,
      "optimizer must be a Keras optimizer or a factory"),
    C("optimizer-is-loss", "a Loss as the optimizer",
      lambda: _new(optimizer=keras.losses.MeanSquaredError()), TypeError,
      r"got a Keras loss \(MeanSquaredError\)"),
    C("optimizer-string", "optimizer='adam'", lambda: _new(optimizer="adam"), TypeError,
      "optimizer must be a Keras optimizer or a factory"),
    C("optimizer-factory-loss", "an optimizer factory returning a loss",
      lambda: _new(optimizer=lambda: keras.losses.MeanSquaredError()), TypeError,
      "optimizer factory must return a keras optimizer"),
    C("loss-none", "loss=None", lambda: _new(loss=None), TypeError,
      "loss must be a Keras loss, a loss name or a callable"),
    C("loss-number", "loss=42", lambda: _new(loss=42), TypeError,
      "loss must be a Keras loss, a loss name or a callable"),
    C("loss-unknown-name", "loss='nope'", lambda: _new(loss="nope"), ValueError,
      "unknown Keras loss name 'nope'"),
    C("loss-is-optimizer", "an optimizer as the loss",
      lambda: _new(loss=keras.optimizers.SGD()), TypeError, r"got a Keras optimizer \(SGD\)"),
    C("loss-is-model", "a model as the loss", lambda: _new(loss=_dense()), TypeError,
      "loss must be .*got a keras.Model"),
    C("loss-output-batch-mean", "a loss function returning a mean over the batch",
      lambda: _new(loss=lambda y, p: keras.ops.mean(p, axis=0)).train_step(X, Y), ValueError,
      r"loss must return one value per example \(first axis = the batch"),
    C("loss-output-integer", "a loss function returning integers",
      lambda: _new(loss=lambda y, p: keras.ops.cast(p[:, 0], "int32")).train_step(X, Y),
      ValueError, "loss must return floating-point values"),
    C("devices-empty", "devices=[]", lambda: _new(devices=[]), ValueError, "devices is empty"),
    C("devices-string", "devices='/device:CPU:0'", lambda: _new(devices="/device:CPU:0"),
      TypeError, "devices must be a list of device names"),
    C("devices-ints", "devices=[0, 1]", lambda: _new(devices=[0, 1]), TypeError,
      "devices must hold strings"),
    C("devices-unknown", "a device TensorFlow does not have",
      lambda: _new(devices=["/device:CPU:99"]), ValueError, "unknown device"),
    C("devices-twice", "one device twice", lambda: _new(devices=[DEVICES[0], DEVICES[0]]),
      ValueError, "appears twice"),
    C("all-reduce-unknown", "all_reduce='nope'", lambda: _new(all_reduce="nope"), ValueError,
      "'nope'"),
    C("all-reduce-number", "all_reduce=42", lambda: _new(all_reduce=42), TypeError,
      "all_reduce"),
    C("variables-unknown", "variables='mirrored'", lambda: _new(variables="mirrored"),
      ValueError, "variables must be one of parameter_device, replicated"),
    C("semantics-unknown", "semantics='median'",
      lambda: _new(semantics="median"), ValueError,
      "semantics must be one of one_device, mirrored"),
    C("non-trainable", "non_trainable='first_tower'",
      lambda: _new(non_trainable="first_tower"), TypeError,
      "non_trainable= is not an option; non-trainable state follows semantics"),
    C("option-unknown", "an unknown keyword (semantic='mirrored')",
      lambda: _new(semantic="mirrored"), TypeError,
      "TowerTrainer got an unexpected option 'semantic'"),
    C("sparse-unknown", "sparse='dense'", lambda: _new(sparse="dense"), ValueError,
      "sparse must be one of"),
    C("update-nonfinite", "SGD(1e37) on large finite gradients, on_nonfinite='raise'",
      lambda: _new(optimizer=lambda: keras.optimizers.SGD(1e37), on_nonfinite="raise")
      .train_step(X * 1e4, Y), towers.NonFiniteError,
      r"the optimizer's update of \S+ \(its gradients were finite"),
    C("reducer-shared", "one compressed('ring', 'topk(0.5)') object handed to two trainers",
      _shared_reducer, ValueError, r"all_reduce: Compressed object .* already serves another "
      r"trainer.*Make a new one"),
    C("all-reduce-hangs", "all_reduce=a function waiting on a queue nobody fills, "
      "step_timeout=2", _hangs_at_construction, TimeoutError,
      r"all_reduce: _queue did not complete within 2 s .* at construction"),
    C("on-nonfinite-unknown", "on_nonfinite='warn'", lambda: _new(on_nonfinite="warn"),
      ValueError, "on_nonfinite must be one of skip, raise, ignore"),
    C("step-timeout-zero", "step_timeout=0", lambda: _new(step_timeout=0), ValueError,
      "step_timeout must be None or seconds > 0"),
    C("step-timeout-string", "step_timeout='10'", lambda: _new(step_timeout="10"), ValueError,
      "step_timeout must be None or seconds > 0"),
    C("check-replicas-zero", "check_replicas_every=0", lambda: _new(check_replicas_every=0),
      ValueError, "check_replicas_every must be None or an int >= 1"),
    C("algorithm-too-few", "an all_reduce callable returning one output too few",
      lambda: _new(all_reduce=_too_few).train_step(X, Y), AlgorithmError,
      r"'_too_few' broke the contract .*2 outputs \(one per tower\), got 1"),
    C("algorithm-wrong-device", "an all_reduce callable returning outputs on one device",
      lambda: _new(all_reduce=_one_device).train_step(X, Y), AlgorithmError,
      r"'_one_device' .*output 1 \(tower 1\) should be .*CPU:1', got .*CPU:0'"),
    C("parameter-device-unknown", "parameter_device='/device:CPU:99'",
      lambda: _new(parameter_device="/device:CPU:99"), ValueError, "unknown device"),
    # -- trainer.train_step(x, y, sample_weight) ---------------------------------------------
    C("x-none", "x=None", lambda: _step(None), ValueError, "x is None"),
    C("y-none", "y=None", lambda: _step(X, None), ValueError, "y is None"),
    C("y-strings", "y of strings", lambda: _step(X, np.array(["cat"] * 8)), TypeError,
      "y holds strings: expected numbers"),
    C("x-strings", "x of strings", lambda: _step(np.full([8, 5], "a")), TypeError,
      "x holds strings"),
    C("x-objects", "x of mixed Python objects", lambda: _step(np.array(
        [[1, "a", None, 2.0, 3]] * 8, dtype=object)), TypeError, "x holds dtype object"),
    C("x-complex", "x of complex numbers", lambda: _step(X.astype("complex64")), TypeError,
      "x holds dtype complex64"),
    C("x-ragged-tensor", "x a tf.RaggedTensor",
      lambda: _step(tf.ragged.constant([[1.0] * 5] * 7 + [[1.0] * 4])), TypeError,
      r"x is a tf.RaggedTensor: pad it"),
    C("y-ragged-tensor", "y a tf.RaggedTensor",
      lambda: _step(X, tf.ragged.constant([[0]] * 7 + [[0, 1]])), TypeError,
      "y is a tf.RaggedTensor"),
    C("x-ragged-list", "x a list of rows of different lengths",
      lambda: _step([[1.0] * 5] * 7 + [[1.0] * 4]), ValueError, "x is ragged"),
    C("x-sparse", "x a tf.SparseTensor", lambda: _step(tf.sparse.from_dense(X)), TypeError,
      "x is a tf.SparseTensor"),
    C("x-dataset", "x a tf.data.Dataset",
      lambda: _step(tf.data.Dataset.from_tensor_slices(X)), TypeError, "use towers.TowerModel.fit"),
    C("x-generator", "x a generator", lambda: _step(_gen()), TypeError,
      "use towers.TowerModel.fit"),
    C("lengths-differ", "x of 8 rows, y of 7", lambda: _step(X, Y[:7]), ValueError,
      r"must share their batch size; got x: \[8\], y: \[7\]"),
    C("weight-length", "sample_weight of 3 rows", lambda: _step(X, Y, np.ones([3])),
      ValueError, "sample_weight: \\[3\\]"),
    C("weight-strings", "sample_weight of strings",
      lambda: _step(X, Y, np.array(["1"] * 8)), TypeError, "sample_weight holds strings"),
    C("batch-empty", "a batch of 0 rows", lambda: _step(X[:0], Y[:0]), ValueError,
      "the batch is empty"),
    C("x-scalar", "x a scalar", lambda: _step(np.float32(1.0), Y), ValueError,
      r"x has shape \[\]; the model's input"),
    C("x-feature-shape", "x with 6 features for a model of 5",
      lambda: _step(np.ones([8, 6], "float32")), ValueError,
      r"x has shape \[8, 6\]; the model's input .* takes \['batch', 5\]"),
    C("x-rank", "x of rank 3 for a model of rank 2",
      lambda: _step(np.ones([8, 5, 1], "float32")), ValueError, r"x has shape \[8, 5, 1\]"),
    C("dict-missing-key", "a dict input missing a key",
      lambda: _step({"a": np.ones([8, 3])}, kind="dict"), ValueError,
      r"x is missing the model's input\(s\) \['b'\]"),
    C("dict-extra-key", "a dict input with an unknown key",
      lambda: _step({"a": np.ones([8, 3]), "b": np.ones([8, 2]), "c": np.ones([8, 1])},
                    kind="dict"), ValueError, r"x has key\(s\) \['c'\] the model has no input"),
    C("dict-not-given", "an array for a model with dict inputs",
      lambda: _step(np.ones([8, 5]), kind="dict"), ValueError,
      r"x must be a dict with keys \['a', 'b'\]"),
    C("dict-feature-shape", "a dict input with a wrong feature shape",
      lambda: _step({"a": np.ones([8, 3]), "b": np.ones([8, 3])}, kind="dict"), ValueError,
      r"x\['b'\] has shape \[8, 3\]"),
    C("inputs-too-few", "one array for a model of two inputs",
      lambda: _step(np.ones([8, 3]), kind="two"), ValueError,
      r"x has 1 arrays; the model takes 2 input\(s\)"),
    C("inputs-too-many", "three arrays for a model of two inputs",
      lambda: _step([np.ones([8, 3])] * 3, kind="two"), ValueError, "x has 3 arrays"),
    C("inputs-order", "two inputs swapped",
      lambda: _step([np.ones([8, 2]), np.ones([8, 3])], kind="two"), ValueError,
      r"x\[0\] has shape \[8, 2\]"),
    # -- towers.training.backup.ExactResume (TowerModel.fit's exact resume) ---------------------
    C("resume-directory-int", "ExactResume(-1)", lambda: ExactResume(-1), TypeError,
      r"directory must be a path \(str or os.PathLike\)"),
    C("resume-every-zero", "ExactResume(d, every=0)", lambda: ExactResume("unused", every=0),
      ValueError, "every must be None or an int >= 1"),
    C("resume-keep-zero", "ExactResume(d, keep=0)", lambda: ExactResume("unused", keep=0),
      ValueError, "keep must be an int >= 1"),
    C("resume-string", "ExactResume(d, resume='yes')",
      lambda: ExactResume("unused", resume="yes"), TypeError, "resume must be True or False"),
    C("resume-shuffled", "TowerModel.fit(x, y, shuffle=True, callbacks=[ExactResume(d)])",
      _fit_shuffled, ValueError, "shuffle must be False with ExactResume and array data"),
    # -- trainer.set_weights -------------------------------------------------------------------
    C("weights-count", "set_weights with one array too few",
      lambda: _trainer("dense").set_weights([np.ones([5, 3])]), ValueError,
      r"weights: expected 2 arrays \(model.weights\), got 1"),
    C("weights-shape", "set_weights with a wrong shape",
      lambda: _trainer("dense").set_weights([np.ones([5, 3]), np.ones([4])]), ValueError,
      r"weights\[1\] \(variable dense\w*/bias, float32\[3\]\): got shape \[4\]"),
    C("weights-strings", "set_weights with strings",
      lambda: _trainer("dense").set_weights([np.ones([5, 3]), np.array(["a"] * 3)]),
      TypeError, r"weights\[1\] .*expected numbers"),
    C("weights-array", "set_weights with one array, not a list",
      lambda: _trainer("dense").set_weights(np.ones([5, 3])), TypeError,
      "weights must be a list of arrays"),
    # -- towers.all_reduce, towers.split, checkpoints -------------------------------------------
    C("all-reduce-tensor", "towers.all_reduce(one tensor)",
      lambda: towers.all_reduce(_on_devices()[0]), TypeError, "values must be a list"),
    C("all-reduce-empty", "towers.all_reduce([])", lambda: towers.all_reduce([]), ValueError,
      "values is empty"),
    C("all-reduce-floats", "towers.all_reduce([1.0, 2.0])",
      lambda: towers.all_reduce([1.0, 2.0]), TypeError, r"values\[0\] must be a tf.Tensor"),
    C("all-reduce-op", "towers.all_reduce(values, op='avg')",
      lambda: towers.all_reduce(_on_devices(), op="avg"), ValueError, "op must be one of"),
    C("all-reduce-algorithm", "towers.all_reduce(values, algorithm='nope')",
      lambda: towers.all_reduce(_on_devices(), algorithm="nope"), ValueError, "'nope'"),
    C("split-zero", "towers.split(x, 0)", lambda: towers.split(X, 0), ValueError,
      "n must be an int >= 1"),
    C("restore-missing", "checkpoint.restore from a path with nothing",
      lambda: checkpoint.restore(_trainer("dense"), "/nonexistent/ckpt"), towers.CheckpointError,
      "checkpoint '/nonexistent/ckpt': cannot be read"),
    # -- found by the API fuzz (tests/guard/test_fuzz.py) ---------------------------------------
    C("devices-unparsable", "devices=['ô'] (not a device name)", lambda: _new(devices=["ô"]),
      ValueError, "devices: Unknown attribute 'ô'"),
    C("parameter-device-unparsable", "parameter_device='ô'",
      lambda: _new(parameter_device="ô"), ValueError, "parameter_device: Unknown attribute"),
    C("variables-list", "variables=['replicated']", lambda: _new(variables=["replicated"]),
      TypeError, "variables: unhashable type"),
    C("all-reduce-algorithm-none", "towers.all_reduce(values, algorithm=None)",
      lambda: towers.all_reduce(_on_devices(), algorithm=None), TypeError,
      "algorithm: all_reduce must be a registered name or a callable"),
    C("all-reduce-algorithm-layer", "towers.all_reduce(values, algorithm=a Keras layer)",
      lambda: towers.all_reduce(_on_devices(), algorithm=keras.layers.Dense(2)), TypeError,
      r"algorithm <Dense.*failed: .*unexpected keyword argument 'op'"),
    C("all-reduce-devices-object", "towers.all_reduce(values, devices=object())",
      lambda: towers.all_reduce(_on_devices(), devices=object()), TypeError,
      "devices must be None or a list of device names"),
    C("simulate-gpu-memory-none", "towers.simulate_devices(n, gpu_memory_mb=None)",
      lambda: towers.simulate_devices(len(DEVICES), kind="cpu", gpu_memory_mb=None), TypeError,
      "gpu_memory_mb must be an int"),
    C("save-path-none", "checkpoint.save(trainer, None)",
      lambda: checkpoint.save(_trainer("dense"), None), TypeError,
      r"path must be a file prefix \(str or os.PathLike\); got None"),
    C("save-trainer-none", "checkpoint.save(None, path)", lambda: checkpoint.save(None, "c"),
      TypeError, "trainer must be a towers.TowerTrainer; got NoneType"),
    C("load-no-manifest", "checkpoint.load of a prefix with no manifest",
      lambda: checkpoint.load(_trainer("dense"), "/nonexistent/ckpt-1/state"),
      towers.CheckpointError, "checkpoint '/nonexistent/ckpt-1/state': manifest or position"),
    C("latest-not-a-path", "checkpoint.latest(None)", lambda: checkpoint.latest(None),
      TypeError, "directory must be a path"),
    C("on-nonfinite-array", "on_nonfinite=np.zeros(2)",
      lambda: _new(on_nonfinite=np.zeros(2)), ValueError,
      "on_nonfinite must be one of skip, raise, ignore"),
    C("all-reduce-array", "all_reduce=an array of objects",
      lambda: _new(all_reduce=np.array([object(), None])), TypeError,
      "all_reduce must be a registered name or a callable"),
    C("y-empty-list", "y=[]", lambda: _step(X, []), ValueError, r"y is empty \(\[\]\)"),
    C("y-dict-one-output", "y a dict for a model with one output",
      lambda: _step(X, {"out": Y}), ValueError,
      r"y is a dict \(keys \['out'\]\); the model has one output"),
    C("weight-dict", "sample_weight a dict", lambda: _step(X, Y, {"w": np.ones(8)}), TypeError,
      "sample_weight must be an array .*got a dict"),
    C("weight-per-output-list", "sample_weight=[w_a, w_b], one array per output (Keras's form)",
      lambda: _new(_two_outputs, loss=[LOSS, LOSS]).train_step(X, [Y, Y], [np.ones(8)] * 2),
      TypeError, "sample_weight must be an array .*got a list of 2 arrays, one per output"),
    C("weight-per-element-mismatch", "sample_weight of shape [8, 4] for one loss value per example",
      lambda: _step(X, Y, np.ones((8, 4), "f4")), ValueError,
      r"sample_weight of shape \[.*, 4\] weighs the loss's elements, but the loss values"),
    C("all-reduce-noop", "all_reduce='noop' (the benchmarks' ceiling: no exchange)",
      lambda: _new(all_reduce="noop"), towers.AlgorithmError,
      "all-reduce algorithm 'noop' broke the contract .*should be the sum"),
    C("all-reduce-spec-missing", "all_reduce='no_such_module:star' (module:NAME)",
      lambda: _new(all_reduce="no_such_module:star"), ValueError,
      "cannot import 'no_such_module' for all_reduce no_such_module:star"),
    C("all-reduce-op-array", "towers.all_reduce(values, op=np.zeros(2))",
      lambda: towers.all_reduce(_on_devices(), op=np.zeros(2)), ValueError,
      "op must be one of"),
    C("all-reduce-devices-ints", "towers.all_reduce(values, devices=[0, 1])",
      lambda: towers.all_reduce(_on_devices(), devices=[0, 1]), TypeError,
      "devices must be None or a list of device names"),
    C("simulate-huge", "towers.simulate_devices(2**31)",
      lambda: towers.simulate_devices(2**31), ValueError, "n must be at most 4096"),
    C("all-reduce-sparse-array", "towers.all_reduce(values, sparse=np.zeros(2))",
      lambda: towers.all_reduce(_on_devices(), sparse=np.zeros(2)), ValueError,
      "sparse must be 'gather' or 'densify'"),
    # -- combinations: the capability table (towers/guard/capabilities.py) ---------------------
    C("all-reduce-a-loss", "all_reduce=keras.losses.MeanSquaredError() (callable, no algorithm)",
      lambda: _new(all_reduce=keras.losses.MeanSquaredError()), TypeError,
      r"all_reduce: .* is not an all-reduce algorithm"),
    C("sharded-compressed", "variables='sharded', all_reduce=compressed('ring', 'topk')",
      lambda: _new(variables="sharded", all_reduce=towers.compressed("ring", "topk")),
      ValueError, r"variables='sharded' with all_reduce=compressed\(ring.*TopK\).*is refused"),
    C("sharded-bucketed", "variables='sharded', all_reduce=bucketed('ring', 1024)",
      lambda: _new(variables="sharded", all_reduce=towers.bucketed("ring", 1024)), ValueError,
      r"all_reduce=bucketed\(ring.*, 1024\).*is refused.*leave all_reduce unset"),
    C("sharded-tree", "variables='sharded', all_reduce='tree'",
      lambda: _new(variables="sharded", all_reduce="tree"), ValueError,
      "variables='sharded' with all_reduce='tree'"),
    C("sharded-gather", "variables='sharded', sparse='gather'",
      lambda: _new(variables="sharded", sparse="gather"), ValueError,
      "variables='sharded' with sparse='gather' is refused.*sparse='densify'"),
    C("sharded-sparse-adam", "variables='sharded', an Embedding and Adam (sparse unset)",
      lambda: _new(_embedding, variables="sharded"), ValueError,
      r"variables='sharded' with layers \['embedding.*'\] .* optimizer Adam is refused.*"
      "sparse='densify'"),
    C("sync-batch-norm", "BatchNormalization(synchronized=True) over 2 towers, jit_compile=True",
      lambda: _new(_synced_norm, jit_compile=True), ValueError,
      r"layers \['synced'\] are BatchNormalization\(synchronized=True\): "
      r"batch_norm='synchronized' with jit_compile='on' is refused"),
    C("sharded-ema", "variables='sharded' with an optimizer of use_ema=True",
      lambda: _new(optimizer=lambda: keras.optimizers.Adam(0.1, use_ema=True),
                   variables="sharded"), ValueError,
      "optimizer: use_ema=True keeps its moving averages .*use variables='replicated'"),
    C("sharded-loss-scale", "variables='sharded' with a LossScaleOptimizer",
      lambda: _new(optimizer=lambda: keras.optimizers.LossScaleOptimizer(
          keras.optimizers.SGD(0.1)), variables="sharded"), ValueError,
      "variables='sharded' with optimizer='loss_scale' is refused"),
    C("compressed-gather", "all_reduce=compressed('ring', 'fp16'), sparse='gather'",
      lambda: _new(_embedding, all_reduce=towers.compressed("ring", "fp16"), sparse="gather"),
      ValueError, r"all_reduce=compressed\(ring.*Cast\).*sparse='gather' is refused"),
    C("tower-cross-worker", "TowerTrainer(all_reduce=AllTowers(2)) (op='sum' over 2 workers)",
      lambda: _new(all_reduce=AllTowers(2)), ValueError,
      r"in a TowerTrainer: .*multiplies the gradient by 2; use op='mean'.*WorkerTrainer"),
    C("worker-sharded", "WorkerTrainer(num_workers=1, variables='sharded')",
      lambda: WorkerTrainer(_dense, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:2],
                            num_workers=1, variables="sharded"), ValueError,
      "trainer='WorkerTrainer' with variables='sharded' is refused"),
    C("worker-local", "WorkerTrainer(num_workers=2, all_reduce='ring')",
      lambda: WorkerTrainer(_dense, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:2],
                            num_workers=2, all_reduce="ring"), ValueError,
      r"WorkerTrainer\(num_workers=2\) needs an all_reduce across those 2 workers"),
    C("async-nonfinite", "AsyncTrainer(on_nonfinite='warn')",
      lambda: _dense_async(learning_rate=0.1, on_nonfinite="warn"), ValueError,
      "on_nonfinite must be one of skip, raise, ignore"),
    C("async-lr", "AsyncTrainer(learning_rate=0)", lambda: _dense_async(learning_rate=0),
      ValueError, "learning_rate must be positive"),
    C("restore-optimizer", "restore an SGD(momentum) checkpoint into an RMSprop trainer",
      lambda: _restore_into(lambda: keras.optimizers.RMSprop(0.1)), towers.CheckpointError,
      "checkpoint holds optimizer SGD .*trainer has RMSprop"),
    C("restore-hyper", "restore it into SGD(momentum=0.5)",
      lambda: _restore_into(lambda: keras.optimizers.SGD(0.1, momentum=0.5)),
      towers.CheckpointError, r"momentum=0.9 in the checkpoint, 0.5 here"),
    C("restore-placement", "restore a replicated checkpoint into variables='parameter_device'",
      lambda: _restore_into(lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                            variables="parameter_device"), towers.CheckpointError,
      "checkpoint holds variables='replicated', trainer has variables='parameter_device'"),
    # -- the step's newer options, TowerModel, the input pipeline, codecs ------------------
    C("loss-denominator-name", "loss_denominator='half'",
      lambda: _new(loss_denominator="half"), ValueError, _DENOMINATOR),
    C("loss-denominator-zero", "loss_denominator=0", lambda: _new(loss_denominator=0),
      ValueError, _DENOMINATOR),
    C("loss-denominator-per-replica", "loss_denominator='per_replica'",
      lambda: _new(loss_denominator="per_replica"), ValueError,
      "loss_denominator='per_replica' is semantics='mirrored'"),
    C("mirrored-sum", "semantics='mirrored' with a reduction='sum' loss",
      lambda: _new(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                   reduction="sum"),
                   semantics="mirrored"), ValueError,
      "semantics='mirrored' with a loss of reduction='sum' is refused"),
    C("mirrored-loss-scale-clip", "semantics='mirrored', a LossScaleOptimizer that clips",
      lambda: _new(optimizer=keras.optimizers.LossScaleOptimizer(
          keras.optimizers.SGD(0.1, clipnorm=1.0)), semantics="mirrored"), ValueError,
      r"semantics='mirrored' with a LossScaleOptimizer whose optimizer clips \(clipnorm\)"),
    C("forward-graph", "forward_graph='eager'", lambda: _new(forward_graph="eager"),
      ValueError, "forward_graph must be one of default, as_written"),
    C("jit-compile", "jit_compile='yes'", lambda: _new(jit_compile="yes"), TypeError,
      "jit_compile must be True or False"),
    C("tower-model-own-step", "TowerModel(a model overriding train_step, compute_loss)",
      lambda: towers.TowerModel(_own_step(), devices=DEVICES[:2]), TypeError,
      "model: _OwnStep overrides train_step, compute_loss; TowerModel runs the towers' own "
      "step"),
    C("tower-model-model", "TowerModel('mlp')",
      lambda: towers.TowerModel("mlp", devices=DEVICES[:2]), TypeError,
      "model must be a keras.Model or a factory"),
    C("tower-model-losses", "two losses for a model with one output (TowerModel.compile)",
      lambda: towers.TowerModel(_dense(), devices=DEVICES[:2]).compile("sgd", [LOSS, LOSS]),
      ValueError, r"loss: 2 entries for a model with 1 outputs"),
    C("tower-model-loss-weights", "TowerModel.compile(loss_weights=0.5)",
      lambda: towers.TowerModel(_dense(), devices=DEVICES[:2]).compile(
          "sgd", LOSS, loss_weights=0.5), TypeError,
      "loss_weights must be a list or a dict by output name"),
    C("tower-model-jit", "TowerModel.compile(jit_compile=True)",
      lambda: towers.TowerModel(_dense(), devices=DEVICES[:2]).compile(
          "sgd", LOSS, jit_compile=True), ValueError,
      r"jit_compile must be False or 'auto' in TowerModel.compile"),
    C("distribute-arrays", "towers.split.distribute((x, y), devices)",
      lambda: distribute((X, Y), DEVICES[:2]), TypeError,
      "dataset must be a tf.data.Dataset of global batches"),
    C("distribute-pipeline", "distribute(..., pipeline='host')",
      lambda: distribute(tf.data.Dataset.from_tensor_slices((X, Y)).batch(4), DEVICES[:2],
                         pipeline="host"), ValueError,
      "pipeline must be one of multi_device, per_device"),
    C("shards-tuple", "trainer.train_step_shards((x, y))",
      lambda: _new().train_step_shards((X, Y)), TypeError,
      r"shards must be a towers.split.Shards"),
    C("keras-step-flag", "trainer.train_step_as_keras(x, y, None, batch_unknown='yes')",
      lambda: _new().train_step_as_keras(X, Y, None, batch_unknown="yes"), TypeError,
      "batch_unknown must be True or False"),
    C("codec-unknown", "compressed('ring', 'nope')", lambda: towers.compressed("ring", "nope"),
      ValueError, "unknown codec 'nope'"),
    C("codec-module", "compressed('ring', 'no_such_module:X')",
      lambda: towers.compressed("ring", "no_such_module:X"), ValueError,
      "cannot import 'no_such_module' for codec"),
]  # fmt: skip


def _on_devices() -> list[tf.Tensor]:
    out = []
    for d in DEVICES[:2]:
        with tf.device(d):
            out.append(tf.ones([3]))
    return out


def test_the_matrix_is_large_and_its_ids_unique() -> None:
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=c.pending)) if c.pending else c
     for c in CASES],
    ids=[c.id for c in CASES],
)  # fmt: skip
def test_bad_input_gets_a_clear_error_and_changes_nothing(case: Case) -> None:
    before = {k: replica_bytes(_trainer(k)) for k in ("dense", "dict", "two")}
    with pytest.raises(case.error, match=case.fragment) as info:
        case.call()
    assert type(info.value).__module__.split(".")[0] in ("builtins", "towers"), info.value
    for kind, state in before.items():
        assert replica_bytes(_trainer(kind)) == state, f"{kind} trainer changed"


@pytest.mark.parametrize(
    ("kind", "x"),
    [("dense", X), ("dict", {"a": np.ones([8, 3], "float32"), "b": np.ones([8, 2], "float32")}),
     ("two", [np.ones([8, 3], "float32"), np.ones([8, 2], "float32")])],
)  # fmt: skip
def test_good_inputs_of_every_shape_still_train(kind: str, x: Any) -> None:
    trainer = _new({"dense": _dense, "dict": _dict_model, "two": _two_inputs}[kind])
    before = replica_bytes(trainer)
    assert np.isfinite(float(trainer.train_step(x, Y)))
    assert replica_bytes(trainer) != before


def table() -> str:
    """The matrix as the Markdown table docs/bad_inputs.md shows."""
    rows = ["| # | input | error | message contains |", "|---|---|---|---|"]
    for i, c in enumerate(CASES, 1):
        fragment = c.fragment.replace("\\", "").replace("|", "\\|")
        note = f" (not yet: {c.pending})" if c.pending else ""
        rows.append(f"| {i} | {c.input} | `{c.error.__name__}`{note} | `{fragment}` |")
    return "\n".join(rows)


def test_docs_show_the_same_table() -> None:
    text = DOC.read_text()
    assert table() in text and cli_table() in text, "regenerate: python -m tests.test_bad_inputs"


# -- the command line: nonsense exits 2 with a one-line error, no traceback ---------------------

CLI_CASES = [
    ("train", "--epochs", "-1", "argument --epochs: must be an integer >= 1, got -1"),
    ("train", "--epochs", "two", "argument --epochs: expected an integer, got 'two'"),
    ("train", "--towers", "0", "argument --towers: must be an integer >= 1, got 0"),
    ("train", "--batch-size", "0", "argument --batch-size: must be an integer >= 1, got 0"),
    ("train", "--lr", "0", "argument --lr: must be a finite number > 0, got 0"),
    ("train", "--lr", "nan", "argument --lr: must be a finite number > 0, got nan"),
    ("train", "--seed", "-3", "argument --seed: must be an integer >= 0, got -3"),
    ("train", "--algorithm", "nope",
     "argument --algorithm: unknown algorithm 'nope' (did you mean 'noop'?)"),
    ("bench", "--sizes", "0", "argument --sizes: must be an integer >= 1, got 0"),
    ("bench", "--sizes", "4096,-8", "argument --sizes: must be an integer >= 1, got -8"),
    ("bench", "--sizes", ",", "argument --sizes: expected a comma list of integers"),
    ("bench", "--towers", "0", "argument --towers: must be an integer >= 1, got 0"),
    ("bench", "--rounds", "0", "argument --rounds: must be an integer >= 1, got 0"),
    ("bench", "--step-rounds", "-1", "argument --step-rounds: must be an integer >= 1, got -1"),
    ("bench", "--batch-size", "0", "argument --batch-size: must be an integer >= 1, got 0"),
    ("bench", "--workers", "1", "argument --workers: must be an integer >= 2, got 1"),
]


@pytest.mark.parametrize(("command", "option", "value", "message"), CLI_CASES,
                         ids=[f"{c[0]}{c[1]}={c[2]}" for c in CLI_CASES])  # fmt: skip
def test_cli_refuses_nonsense_with_exit_2_and_one_line(
    command: str, option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from towers.cli import main

    with pytest.raises(SystemExit) as info:
        main([command, option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"towers {command}: error: {message}")
    assert not any("Traceback" in line for line in err)


def test_cli_error_in_a_fresh_process_has_no_traceback() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, "-m", "towers", "train", "--towers", "0"],
                          capture_output=True, text=True, env=env, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "towers train: error: argument --towers: must be an integer >= 1, got 0"
    )


def cli_table() -> str:
    """The command-line cases as the Markdown table docs/bad_inputs.md shows."""
    rows = ["| command | exit | last line of stderr starts with |", "|---|---|---|"]
    for command, option, value, message in CLI_CASES:
        rows.append(f"| `towers {command} {option} {value}` | 2 | `towers {command}: error: "
                    f"{message}` |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(), cli_table(), sep="\n\n")
