"""``check_codec``: a codec against its contract (:class:`towers.allreduce.codecs.Codec`):
error feedback, placement, bitwise agreement, state, ``payload_bytes``, checkpoints, skips."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.codecs import Codec, Wire
from towers.allreduce.compressed import Compressed, compressed
from towers.allreduce.machinery.resolve import get, get_codec
from towers.allreduce.machinery.rounding import rounding
from towers.devices import canonical_device, local_devices
from towers.guard.arguments import positive_int
from towers.step import TowerTrainer
from towers.testing.bounds import summation_depth
from towers.testing.check import verdict
from towers.testing.replay import place
from towers.testing.strategies import ModelSpec
from towers.training import checkpoint

__all__ = ["SHAPES", "CodecReport", "check_codec"]

# a scalar, a vector, and two matrices PowerSGD compresses
SHAPES: tuple[tuple[int, ...], ...] = ((), (7,), (8, 6), (2, 3, 4, 5))


@dataclasses.dataclass(frozen=True, repr=False)
class CodecReport:
    """What :func:`check_codec` found. ``bool(report)`` is ``report.ok``; ``str`` the verdict."""

    codec: str
    ok: bool
    failures: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return verdict(self.ok, f"codec {self.codec}", self.notes, self.failures)

    __repr__ = __str__


@dataclasses.dataclass(frozen=True)
class _MeteredWire(Wire):
    """A wire that adds up the bytes each tower hands it (all-reduce inputs, gathers)."""

    handed: list[int] = dataclasses.field(default_factory=list)

    def all_reduce(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        self._count(values)
        return super().all_reduce(values)

    def gather(self, values: Sequence[tf.Tensor], dst: int) -> list[tf.Tensor]:
        self._count(values)
        return super().gather(values, dst)

    def _count(self, values: Sequence[tf.Tensor]) -> None:
        for t, value in enumerate(values):
            self.handed[t] += int(value.shape.num_elements()) * value.dtype.size


def _differ(outs: Sequence[tf.Tensor]) -> tuple[list[np.ndarray], list[int]]:
    """The outputs as arrays, and the towers whose output differs from tower 0's in a bit."""
    values = [np.asarray(o) for o in outs]
    return values, [t for t in range(1, len(values)) if values[t].tobytes() != values[0].tobytes()]


def _structure(state: Any) -> Any:
    return type(state).__name__, [(tuple(x.shape), tf.as_dtype(x.dtype).name) for x in state]


def _residual(state: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The state's ``residual`` field in float64 (zeros when the codec keeps none)."""
    value = getattr(state, "residual", None)
    return np.zeros(shape) if value is None else np.asarray(value, np.float64)


def _step_failures(codec: Codec, where: str, grads: list[tf.Tensor], states: list[Any],
                   wire: _MeteredWire, depth: int) -> tuple[list[str], list[Any]]:
    """One reduce, every per-step property: (failures, the new states)."""
    n, shape, dtype = len(grads), grads[0].shape, grads[0].dtype
    outs, news = codec.reduce(grads, states, wire)
    if len(outs) != n or len(news) != n:
        return [f"{where}: {len(outs)} outputs and {len(news)} states for {n} towers"], states
    failures = [f"{where}: output {t} is on {o.device}, not tower {t}'s {wire.devices[t]}"
                for t, o in enumerate(outs)
                if canonical_device(o.device) != canonical_device(wire.devices[t])]
    values, differ = _differ(outs)
    if differ:
        failures.append(f"{where}: outputs of towers {differ} differ from tower 0's (max "
                        f"|diff| {max(np.max(np.abs(values[t] - values[0])) for t in differ):.3g})")
    changed = [t for t in range(n) if _structure(news[t]) != _structure(states[t])]
    if changed:
        failures.append(f"{where}: tower {changed[0]}'s state changed structure: "
                        f"{_structure(states[changed[0]])} -> {_structure(news[changed[0]])}")
        return failures, states
    failures += _feedback_failures(codec, where, grads, states, news, values[0], depth)
    formula = getattr(codec, "payload_bytes", None)
    if formula is not None:
        expected = int(formula(shape, dtype))
        wrong = [(t, b) for t, b in enumerate(wire.handed) if b != expected]
        if wrong:
            failures.append(f"{where}: tower {wrong[0][0]} handed the wire {wrong[0][1]} bytes; "
                            f"payload_bytes{tuple(shape)} says {expected}")
    return failures, list(news)


def _feedback_failures(codec: Codec, where: str, grads: list[tf.Tensor], states: list[Any],
                       news: list[Any], out: np.ndarray, depth: int) -> list[str]:
    """The error-feedback invariant ``out + Σ r' == Σ (g + r)`` within the stated rounding."""
    n = len(grads)
    g = [np.asarray(x, np.float64) for x in grads]
    old = [_residual(s, out.shape) for s in states]
    lhs = out.astype(np.float64) + sum(_residual(s, out.shape) for s in news)
    rhs = sum(g[t] + old[t] for t in range(n))
    abs_sum = sum(np.abs(g[t]) + np.abs(old[t]) for t in range(n))
    bound_of = getattr(codec, "error_bound", None)
    bound = (rounding(depth + 1, abs_sum) if bound_of is None
             else np.asarray(bound_of(abs_sum, n, depth), np.float64))
    err = np.abs(lhs - rhs)
    if not np.all(err <= bound):
        i = np.unravel_index(int(np.argmax(err - bound)), err.shape) if err.shape else ()
        return [f"{where}: error feedback broken at element {tuple(int(k) for k in i)}: "
                f"output + Σ new residuals = {lhs[i]:.9g}, Σ (gradient + old residual) = "
                f"{rhs[i]:.9g}; |diff| {err[i]:.3g} > bound {bound[i]:.3g}"]
    return []


def _run_shape(codec: Codec, devices: list[str], algorithm: Any, shape: tuple[int, ...],
               steps: int, rng: np.random.Generator) -> list[str]:
    n = len(devices)
    depth = summation_depth(algorithm, n)
    states = []
    for device in devices:
        with tf.device(device):
            states.append(codec.init(tf.TensorShape(shape), tf.float32, 0))
    for step in range(steps):
        grads = place([rng.normal(size=shape).astype(np.float32) for _ in devices], devices)
        wire = _MeteredWire(tuple(devices), algorithm, (0,), [0] * n)
        where = f"n={n} towers, shape {shape}, step {step + 1}"
        failures, news = _step_failures(codec, where, grads, states, wire, depth)
        # every tower decoding for itself: a decode that depends on the tower differs
        everywhere = Wire(tuple(devices), algorithm, tuple(range(n)))
        differ = _differ(codec.reduce(grads, states, everywhere)[0])[1]
        if differ:
            failures.append(f"{where}, decode='everywhere': outputs of towers {differ} differ "
                            "from tower 0's (each tower decodes for itself: decode(t) must not "
                            "depend on t)")
        if failures:
            return failures
        states = news
    return []


def _state(trainer: TowerTrainer, codec: Codec) -> list[bytes]:
    """Every state value and every variable the codec holds itself, as bytes."""
    reducer = trainer.reducer.dense
    assert isinstance(reducer, Compressed)
    own = [v for v in vars(codec).values() if isinstance(v, tf.Variable)]
    state = [v for row in reducer.state for var in row for v in var]
    return [np.asarray(v).tobytes() for v in [*state, *own]]


def _trainer_failures(codec: Codec, devices: list[str], algorithm: Any) -> list[str]:
    """Checkpoint round trip and the skipped step, in a 2-tower trainer."""
    trainer = TowerTrainer(ModelSpec("dense", width=6).build, lambda: keras.optimizers.SGD(0.1),
                           "sparse_categorical_crossentropy", devices=devices[:2],
                           all_reduce=compressed(algorithm, codec), variables="replicated",
                           on_nonfinite="skip")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 5)).astype("float32"), rng.integers(0, 3, 8)
    trainer.train_step(x, y)
    failures, saved = [], _state(trainer, codec)
    with tempfile.TemporaryDirectory() as folder:
        prefix = checkpoint.save(trainer, os.path.join(folder, "ckpt"))
        trainer.train_step(x * 2, y)
        checkpoint.restore(trainer, prefix)
    if _state(trainer, codec) != saved:
        failures.append("checkpoint: the state restored differs from the state saved "
                        "(state kept outside init's tuple is not checkpointed)")
    before, bad = _state(trainer, codec), x.copy()
    bad[5] = np.nan  # tower 1's shard
    trainer.train_step(bad, y)
    if _state(trainer, codec) != before:
        failures.append("skipped step: a non-finite batch (on_nonfinite='skip') changed the state")
    return failures


def check_codec(codec: Codec | str, *, tower_counts: Sequence[int] = (1, 2, 3, 4),
                algorithm: Any = "ring", shapes: Sequence[tuple[int, ...]] = SHAPES,
                steps: int = 3, devices: Sequence[str] | None = None,
                trainer: bool = True, seed: int = 0) -> CodecReport:
    """Check ``codec`` (a codec, a name in ``CODECS`` or ``module:NAME``) against the
    contract, on ``algorithm``'s wire, ``shapes`` (float32 normal values) and ``steps``
    consecutive steps per shape (the state carries over); report every broken promise.
    ``trainer``: also the checkpoint round trip and a skipped step in a 2-tower trainer."""
    built, steps = get_codec(codec), positive_int("steps", steps)
    devices = list(local_devices() if devices is None else devices)
    if max(tower_counts) > len(devices) or (trainer and len(devices) < 2):
        raise ValueError(f"tower_counts {list(tower_counts)} need more than the "
                         f"{len(devices)} devices given: call towers.simulate_devices first")
    notes = [f"bytes not checked: {type(built).__name__} has no payload_bytes(shape, dtype)"
             ] if not hasattr(built, "payload_bytes") else []
    if not hasattr(built, "error_bound"):
        notes.append("no error_bound: the invariant is held to the algorithm's own rounding")
    rng, failures = np.random.default_rng(seed), []
    for n in tower_counts:
        for shape in shapes:
            failures += _run_shape(built, devices[:n], get(algorithm), shape, steps, rng)
    if trainer:
        failures += _trainer_failures(built, devices, algorithm)
    name = codec if isinstance(codec, str) else repr(built)
    return CodecReport(name, not failures, tuple(failures), tuple(notes))
