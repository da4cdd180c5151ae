"""A ``StepTimeout`` says truthfully whether the step was applied, wherever it hangs.

A collective that times out fails the step at the node where it sits. The update
waits for every reduced value (``TowerTrainer._update`` in towers/step.py), so a hang in the
forward pass or the reduction changes nothing; one inside the update (an owner's apply,
or ``sharded``'s all-gather of the updated shards) leaves the step applied in part, and
the error says so (``applied=True``, ``partly=True``): nothing is half-updated silently.

The hang is planted as a node that fails in one phase, a ``py_function`` whose inputs
order it after what the phase did before it, and its error is handed to the deadline
as the ``DeadlineExceededError`` a timed-out collective raises there: deterministic,
and in process (a real timed-out collective aborts every later collective of the
process: tests/guard/test_deadline.py runs those in subprocesses). One real hang inside
the update runs here in a subprocess: an optimizer whose second variable's update waits
on a collective nobody else joins, cut short by the step's deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES, replica_bytes
from towers import step as step_module
from towers.allreduce.machinery import sharding
from towers.guard import deadline
from towers.guard.errors import StepTimeout

PHASES = ("forward", "reduce", "apply", "all_gather")
APPLIED = {"forward": False, "reduce": False, "apply": True, "all_gather": True}


def _raise(*_: Any) -> Any:
    raise RuntimeError("planted: Collective has timed out")


class _TimedOut:
    """A compiled step whose planted node's error reaches the deadline as a timeout's."""

    def __init__(self, step: Any) -> None:
        self.step = step

    def get_concrete_function(self, *inputs: Any) -> Any:
        return self.step.get_concrete_function(*inputs)

    def __call__(self, *inputs: Any) -> Any:
        try:
            return self.step(*inputs)
        except tf.errors.UnknownError as err:
            assert "planted" in err.message, err.message
            raise tf.errors.DeadlineExceededError(None, None, "planted: timed out") from None


def _fails(value: tf.Tensor, *after: Any) -> tf.Tensor:
    """``value`` through a node that fails as a timed-out collective, once ``after`` exist."""
    with tf.device(value.device):
        out = tf.py_function(_raise, [value, *after], value.dtype)
    out.set_shape(value.shape)
    return out


def _plant(phase: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``phase`` fail at one node (for tower, owner or variable 1)."""
    trainer_cls = towers.TowerTrainer
    if phase == "forward":
        forward = trainer_cls.forward_backward

        def forward_backward(self: Any, shards: Any) -> Any:
            grads = forward(self, shards)
            results = list(grads.towers)
            results[1] = results[1]._replace(loss=_fails(results[1].loss))
            return type(grads)(tuple(results))

        monkeypatch.setattr(trainer_cls, "forward_backward", forward_backward)
    elif phase == "reduce":
        reduce = trainer_cls.reduce

        def reducing(self: Any, grads: Any) -> Any:
            reduced = reduce(self, grads)
            owner = next(g for g in reduced.grads if g[1] is not None)
            owner[1] = _fails(owner[1])
            return reduced

        monkeypatch.setattr(trainer_cls, "reduce", reducing)
    elif phase == "apply":
        apply, done = step_module._apply_gradients, []

        def applying(optimizer: Any, grads: list[Any], variables: list[Any]) -> None:
            failed = []
            if len(done) == 1:  # the second replica (owner) fails, after the first applied
                failed = [_fails(*(tf.convert_to_tensor(v.value) for v in done[0]))]
            done.append(variables)
            with tf.control_dependencies(failed):
                apply(optimizer, grads, variables)

        monkeypatch.setattr(step_module, "_apply_gradients", applying)
    else:
        run_slots, seen = sharding.run_slots, []

        def gathering(*args: Any, note: str = "", **kwargs: Any) -> Any:
            out = run_slots(*args, note=note, **kwargs)
            if note == "all_gather":
                seen.append(note)
                if len(seen) == 2:  # the second variable, after the first was gathered
                    out[0][0] = _fails(out[0][0])
            return out

        monkeypatch.setattr(sharding, "run_slots", gathering)


def _trainer(variables: str) -> towers.TowerTrainer:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2)])  # fmt: skip
    algorithm = "ring" if variables == "sharded" else "naive"
    return towers.TowerTrainer(
        model,
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=DEVICES[:3],
        variables=variables,
        all_reduce=algorithm,
        step_timeout=600,  # a step times out only under a deadline (never reached here)
    )


CASES = [("sharded", p) for p in PHASES] + [
    pytest.param("replicated", p, marks=pytest.mark.long) for p in PHASES[:3]
]


@pytest.mark.parametrize("variables,phase", CASES)
def test_a_step_cut_short_says_whether_it_was_applied(
    variables: str, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deadline, "_TIMED_OUT", [])  # no earlier timeout in this process
    trainer = _trainer(variables)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 5)).astype("f4"), rng.integers(0, 2, 6)
    before = replica_bytes(trainer)
    _plant(phase, monkeypatch)
    monkeypatch.setitem(trainer.compiled.steps, False, _TimedOut(trainer.compiled.steps[False]))
    with pytest.raises(StepTimeout) as info:
        trainer.train_step(x, y)
    changed = replica_bytes(trainer) != before
    assert info.value.applied is info.value.partly is APPLIED[phase] is changed, str(info.value)
    said = "WAS applied in part" if APPLIED[phase] else "the step changed nothing"
    assert said in str(info.value) and "planted" in str(info.value)


def test_a_step_that_completes_clears_the_flag() -> None:
    trainer = _trainer("sharded")
    x, y = np.zeros((6, 5), "f4"), np.zeros(6, "int64")
    trainer.train_step(x, y)
    assert bool(trainer.deadline.began.numpy())  # the update began (and completed)
    steps: list[Callable[..., Any]] = []

    def fails(*_: Any) -> Any:  # a step that fails before its update: the flag is cleared
        steps.append(fails)
        raise tf.errors.DeadlineExceededError(None, None, "planted")

    fails.get_concrete_function = lambda *_: None  # type: ignore[attr-defined]
    with pytest.raises(StepTimeout) as info:
        trainer.deadline.run(fails, ())
    assert steps and info.value.applied is False


_REAL_HANG = """
import json
import numpy as np
import keras
import tensorflow as tf
from tensorflow.python.ops import collective_ops
import towers
from towers.allreduce.machinery.tf_collective_ops import next_key

devices = towers.simulate_devices(2)


class Stuck(keras.optimizers.SGD):
    # The second variable's update waits on a collective of a group of 2 that only it
    # joins: a real hang, inside the update, after the first variable's was applied.
    def update_step(self, gradient, variable, learning_rate):
        if tuple(variable.shape) == (4,):  # the first Dense's bias: the second variable
            group, instance = next_key(), next_key()
            with tf.device(variable.device):
                gradient = collective_ops.all_reduce_v2(
                    gradient, 2, group, instance, merge_op="Add", final_op="Id")
        super().update_step(gradient, variable, learning_rate)


model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(2)])
trainer = towers.TowerTrainer(model, Stuck(0.1), "mse", devices=devices,
                              variables="parameter_device", step_timeout=1.5)
x, y = np.ones((4, 5), "f4"), np.ones((4, 2), "f4")
trainer.step_function(x, y)  # traced before the clock starts
before = [w.copy() for w in trainer.get_weights()]
try:
    trainer.train_step(x, y)
    print(json.dumps({"error": None}))
except towers.StepTimeout as err:
    after = trainer.get_weights()
    moved = [i for i, (a, b) in enumerate(zip(before, after)) if not np.array_equal(a, b)]
    print(json.dumps({"error": str(err), "applied": err.applied, "partly": err.partly,
                      "moved": moved}))
"""


@pytest.mark.long
def test_a_real_hang_inside_the_update_says_applied_in_part() -> None:
    # a subprocess: the watchdog's abort stops every later collective of its process
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_REAL_HANG)], cwd=root,
                          capture_output=True, text=True, timeout=300, check=False)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result["error"] and "step's deadline of 1.5 s passed" in result["error"], result
    assert result["applied"] is True and result["partly"] is True, result
    assert "WAS applied in part" in result["error"]
    assert 0 in result["moved"] and 1 not in result["moved"], result  # kernel 0 yes, bias 0 no
