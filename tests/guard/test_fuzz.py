"""Junk for every argument of the public API: it works, or a documented error names it.

For each argument of ``TowerTrainer(...)``, ``train_step``, ``fit``, ``set_weights``,
``towers.all_reduce``, ``checkpoint.save`` / ``restore`` / ``load`` / ``latest`` and
``simulate_devices``, Hypothesis passes junk in that one place (None, booleans,
strings, negative and huge ints, NaN and infinite floats, nested lists, dicts, bytes,
arrays of the wrong dtype or shape, bare objects, a Keras object of another kind) and
the others valid. The property:

- the call works, or it raises one of :data:`ALLOWED` — ``TypeError``, ``ValueError``
  (``towers.CheckpointError`` and ``AlgorithmError`` are both), or any
  ``towers.TowersError``; ``simulate_devices`` may also raise its documented
  ``RuntimeError`` (the runtime already started with another count) — defined in
  ``builtins`` or ``towers``: never a raw ``tf.errors.*``, ``IndexError``,
  ``AttributeError`` or ``KeyError``;
- the message names the argument (its name, or for a path the path itself);
- on an error, nothing changed: every replica's variables, optimizer slots,
  ``iterations`` and the all-reduce's state are bitwise as before;
- nothing hangs: each call runs under a 60 s ``SIGALRM`` (a call stuck inside one
  TensorFlow op would only be interrupted when the op returns, so the bound is the
  suite's timeout there; none was seen).

Every failure this found is now a row of tests/test_bad_inputs.py.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import towers
from tests.conftest import DEVICES, examples
from towers.training import checkpoint
from towers.training.backup import ExactResume

ALLOWED: tuple[type[BaseException], ...] = (TypeError, ValueError, towers.TowersError)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
X = np.linspace(-1, 1, 8 * 5, dtype="float32").reshape(8, 5)
Y = np.array([0, 1, 2, 0, 1, 2, 0, 1], "int32")

OTHER_KINDS = [keras.layers.Dense(2), keras.optimizers.SGD(), keras.losses.MeanSquaredError()]
"""Keras objects of another kind, made once (building them inside a strategy draws from
``random``, which Hypothesis warns about)."""
_TEXT = st.text(
    st.characters(blacklist_characters="/\\\x00", blacklist_categories=("Cs",)), max_size=6
)  # fmt: skip  (no "/": a junk path stays in the test's folder)
_LEAF = st.none() | st.integers(-3, 3) | st.floats() | _TEXT
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    _TEXT,
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2**31, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -0.0]),
    st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3), max_leaves=6),
    st.dictionaries(_TEXT, _LEAF, max_size=2),
    st.just(b"\x00junk"),
    hnp.arrays(
        st.sampled_from(["float64", "int8", "complex64", "bool", "U2", "float16", "uint64"]),
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    ),
    st.builds(lambda: np.array([object(), None], dtype=object)),
    st.builds(object),
    st.sampled_from(OTHER_KINDS),
)


def _make() -> keras.Model:
    inp = keras.Input((5,))
    h = keras.layers.Dense(4, kernel_initializer="ones")(inp)
    return keras.Model(inp, keras.layers.Dense(3, kernel_initializer="ones")(h))


TRAINER = {
    "model": _make, "optimizer": lambda: keras.optimizers.Adam(0.01), "loss": LOSS,
    "devices": DEVICES[:2], "all_reduce": "naive", "variables": "replicated",
    "parameter_device": None, "semantics": "one_device", "sparse": None,
    "on_nonfinite": "skip", "step_timeout": None, "check_replicas_every": None,
}  # fmt: skip


@functools.cache
def _trainer() -> towers.TowerTrainer:
    return towers.TowerTrainer(**{**TRAINER, "all_reduce": towers.compressed("naive", "topk")})


def _state(trainer: towers.TowerTrainer) -> list[bytes]:
    found = [trainer.optimizer.iterations]
    for r in trainer.replicas:
        found += [*r.model.variables, *r.optimizer.variables]
    found += list(trainer.algorithm.variables)
    return [np.asarray(v.numpy()).tobytes() for v in found]


class Hang(Exception):
    """A fuzzed call ran past its time limit."""


@contextlib.contextmanager
def _limit(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"the call ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check(call: Callable[[], Any], names: tuple[str, ...], also: tuple[type, ...] = ()) -> None:
    """Run ``call``: it works, or raises an allowed error naming one of ``names``, and
    then the shared trainer is bitwise unchanged."""
    before = _state(_trainer())
    try:
        with _limit(60):
            call()
    except (*ALLOWED, *also) as err:
        assert type(err).__module__.split(".")[0] in ("builtins", "towers"), repr(err)
        message = str(err)
        assert any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) for n in names), (
            f"{type(err).__name__}: {message!r} names none of {names}"
        )
        assert _state(_trainer()) == before, f"{type(err).__name__} after a partial update"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Junk strings used as paths land in a temporary folder."""
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("arg", sorted(TRAINER))
@settings(max_examples=examples(ci=3))
@given(junk=JUNK)
def test_tower_trainer_arguments(arg: str, junk: Any) -> None:
    check(lambda: towers.TowerTrainer(**{**TRAINER, arg: junk}), (arg,))


STEP = {"x": X, "y": Y, "sample_weight": None}


@pytest.mark.parametrize("arg", sorted(STEP))
@settings(max_examples=examples(ci=5))
@given(junk=JUNK)
def test_train_step_arguments(arg: str, junk: Any) -> None:
    check(lambda: _trainer().train_step(**{**STEP, arg: junk}), (arg,))


RESUME = {"directory": "run", "every": None, "keep": 3, "resume": True}


@pytest.mark.parametrize("arg", sorted(RESUME))
@settings(max_examples=examples(ci=3))
@given(junk=JUNK)
def test_exact_resume_arguments(arg: str, junk: Any) -> None:
    check(lambda: ExactResume(**{**RESUME, arg: junk}), (arg,))


@settings(max_examples=examples(ci=12))
@given(junk=JUNK | st.lists(JUNK, min_size=2, max_size=2))
def test_set_weights(junk: Any) -> None:
    check(lambda: _trainer().set_weights(junk), ("weights",))


def _values() -> list[tf.Tensor]:
    out = []
    for d in DEVICES[:2]:
        with tf.device(d):
            out.append(tf.ones([3]))
    return out


@pytest.mark.parametrize("arg", ["values", "algorithm", "op", "devices", "sparse"])
@settings(max_examples=examples(ci=4))
@given(junk=JUNK)
def test_all_reduce_arguments(arg: str, junk: Any) -> None:
    kwargs = {"values": _values(), "algorithm": "naive", "op": "sum", "devices": None,
              "sparse": "gather", arg: junk}  # fmt: skip
    check(lambda: towers.all_reduce(**kwargs), (arg,))


@pytest.mark.parametrize("function", ["save", "restore", "load"])
@pytest.mark.parametrize("arg", ["trainer", "path"])
@settings(max_examples=examples(ci=3))
@given(junk=JUNK)
def test_checkpoint_arguments(function: str, arg: str, junk: Any) -> None:
    call = getattr(checkpoint, function)
    kwargs = {"trainer": _trainer(), "path": "ckpt", arg: junk}
    named = "prefix" if (function, arg) == ("load", "path") else arg  # load(trainer, prefix)
    names = (named, "checkpoint") + ((str(junk),) if arg == "path" else ())
    check(lambda: call(kwargs["trainer"], kwargs["path"]), names)


@settings(max_examples=examples(ci=6))
@given(junk=JUNK)
def test_latest_directory(junk: Any) -> None:
    check(lambda: checkpoint.latest(junk), ("directory",))


@pytest.mark.parametrize("arg", ["n", "kind", "gpu_memory_mb"])
@settings(max_examples=examples(ci=4))
@given(junk=JUNK)
@example(junk=2**31)  # once a list of 2**31 device configurations: the process was OOM-killed
def test_simulate_devices_arguments(arg: str, junk: Any) -> None:
    kwargs = {"n": len(DEVICES), "kind": "cpu", "gpu_memory_mb": 1024, arg: junk}
    # documented: another n, once TensorFlow's runtime started, is a RuntimeError naming it
    check(lambda: towers.simulate_devices(**kwargs), (arg, "simulate_devices"), (RuntimeError,))


def test_the_property_catches_a_raw_error() -> None:
    """The checker itself: a raw KeyError, or an error naming nothing, fails it."""
    with pytest.raises(KeyError):
        check(lambda: {}["x"], ("x",))
    with pytest.raises(AssertionError, match="names none of"):
        check(lambda: int("junk"), ("batch_size",))
    with pytest.raises(AssertionError, match="partial update"):
        check(lambda: (_trainer().optimizer.iterations.assign_add(1), int("x"))[1],
              ("literal",))  # fmt: skip
