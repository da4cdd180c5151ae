"""The non-finite guard: one decision per step, taken before anything changes.

::

    tower i:   s_i = Σ loss + Σ every gradient + Σ state   (float32; one reduction per value)
                 │  send (4 bytes, note "guard")
                 ▼
    parameter device:  total = Σ_i s_i   finite?  ──yes──▶ codes = 0      (the fast path)
                 │ no (a NaN/Inf, or finite values whose sum overflowed)
                 ▼
               code_i = 1·[loss] + 2·[a gradient] + 4·[state non-finite], elementwise on
               tower i (one tf.cond for the whole step: runs only on doubt)
                 │  bad = #towers with a fatal bit; agree (a worker's trainer: summed
                 ▼  over every worker)
    tf.cond(bad == 0, reduce → apply, skip)    one cond around the whole update

IEEE 754 makes a sum a proof: once a NaN or Inf enters a partial sum, every later one
is non-finite, so a finite total means every element is finite (:func:`tower_sum`).
When the all-reduce :func:`sums_exactly` (the library's own algorithms, no codec, no
reducer state, one process), it runs *before* the cond, and the fast path sums one copy
of the reduced gradients instead of every tower's: each reduced element is an IEEE sum
over all towers, so a NaN or Inf in any tower's gradient is one there. The towers'
gradients are then read once, not once per tower; on doubt the codes still come from
every tower's own values.

The flag is formed from every tower's *local* values (or from an exact sum of them), so a
lossy reducer (top-k, PowerSGD) cannot hide a NaN, and reducer state (error feedback,
compression residuals) is inside the cond too. One predicate gates every replica's
update in the same graph, so every replica decides the same by construction; across
processes (``WorkerTrainer``) the count is summed over the workers first, so every worker
skips or applies together (deciding alone, one would wait in a collective the other left).
``AsyncTrainer`` takes the same codes per push (:func:`gather_codes`): a bad push is not sent. On a
skipped step nothing the next step depends on changes: no weight, optimizer slot,
``optimizer.iterations``, non-trainable state (BatchNorm statistics, dropout seed
state) or reducer state. Only the guard's own counters move.

Modes (``TowerTrainer(on_nonfinite=...)``):

- ``"skip"`` (default): drop the step, count it (``trainer.skipped_steps``) and go on.
  A careful user wants one poisoned batch never to turn the model into NaN (a NaN in
  one tower's shard otherwise reaches every weight and Adam slot of every replica),
  and wants a long run to survive it; the counter and ``fit``'s ``skipped`` log keep
  it visible. Dynamic loss scaling does the same on overflow.
- ``"raise"``: drop the step and raise :class:`~towers.guard.errors.NonFiniteError`
  naming the step and the towers (one host sync per step to read the codes).
- ``"ignore"``: no check at all — the update runs whatever the values, as
  tf.distribute does; the graph is the unguarded one.

On finite steps all three give bitwise the same result: the guard only reads values.

The update itself is checked too (:meth:`Guard.applied`): finite gradients can still
make a non-finite update (SGD with a huge learning rate on large gradients overflows
to Inf; Adam with ``epsilon=0`` divides 0 by 0 where a gradient is zero). The values
every variable held before the update are kept (reads, no copy until the update
writes), the updated values are summed the same way (one sum per variable, one
``add_n``), and on a non-finite total every variable — weights, slots, ``iterations``,
state, reducer state — is assigned its old value in one ``tf.cond``: the step is
skipped and counted, or raised, naming the first variable whose update was non-finite.

With a ``keras.optimizers.LossScaleOptimizer`` (``loss_scaled=True``) a non-finite
*gradient* is an expected event, handled by the dynamic scale
(:mod:`towers.guard.loss_scale`): bit 2 neither skips nor raises nor counts; it is
handed to the update as the step's "gradients finite" flag, which halves the scale
on every replica and leaves weights, slots and ``iterations`` as they were. A
non-finite *loss* (it is the unscaled loss) or non-finite state still follows the
mode: ``"skip"`` changes nothing at all, the scale included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.primitives import log_send, send
from towers.allreduce.machinery.registry import ALGORITHMS, record_of
from towers.devices import canonical_device
from towers.guard.arguments import check_choice
from towers.guard.capabilities import algorithm_kind
from towers.guard.errors import NonFiniteError

__all__ = ["NONFINITE", "Guard", "describe", "gather_codes", "sums_exactly", "tower_code",
           "tower_sum"]

NONFINITE = ("skip", "raise", "ignore")
_WHAT = ((1, "loss"), (2, "gradients"), (4, "non-trainable state"))
_GRADIENTS = 2


def _elementwise(values: Sequence[tf.Tensor]) -> tf.Tensor:
    """Every element of every value finite: one ``is_finite`` pass per value (exact; it
    writes a boolean tensor as large as the value and reads it again, so it runs only on
    doubt: inside :func:`gather_codes`' branch)."""
    if not values:
        return tf.constant(True)
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))


def tower_code(loss: tf.Tensor, grads: Sequence, state: Sequence[tf.Tensor]) -> tf.Tensor:
    """One tower's int32 code: 0 when finite, else a sum of 1 (loss), 2 (gradients), 4 (state).

    Elementwise and branch-free: it is formed only on doubt (:func:`gather_codes`), where
    a per-category sum first would add a ``tf.cond`` per category and tower to every
    step's graph for nothing. Sparse gradients are checked through their values; integer
    state (seed counters) cannot be non-finite and is not read.
    """
    dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    floating = [v for v in state if v.dtype.is_floating]
    code = tf.constant(0, tf.int32)
    for (bit, _), values in zip(_WHAT, ([loss], dense, floating)):
        code += tf.where(_elementwise(values), 0, bit)
    return code


def describe(codes: np.ndarray) -> dict[int, list[str]]:
    """``{tower: ["loss", "gradients", …]}`` for every tower whose code is not 0."""
    return {
        i: [what for bit, what in _WHAT if int(c) & bit]
        for i, c in enumerate(np.asarray(codes).tolist())
        if c
    }


def tower_sum(loss: tf.Tensor, grads: Sequence, state: Sequence[tf.Tensor]) -> tf.Tensor:
    """One tower's float32 proof: finite ⇒ its loss, gradients and state are all finite.

    IEEE 754 makes the sum of all elements a proof: ``x + Inf`` is Inf or NaN and
    ``x + NaN`` is NaN, so once an Inf or NaN enters a partial sum every later partial
    sum is non-finite, whatever the summation order; a finite sum means every element is
    finite. One reduction per value and one ``add_n``, no branch; it reads each value
    once and writes nothing. A non-finite result may be an overflow of finite
    values; :func:`gather_codes` then lets the elementwise :func:`tower_code` decide.
    """
    dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    values = [loss, *dense, *(v for v in state if v.dtype.is_floating)]
    sums = [tf.cast(tf.reduce_sum(v), tf.float32) for v in values]
    return tf.add_n(sums) if len(sums) > 1 else sums[0]


def _reduced_sums(reduced: Sequence, device: str) -> list[tf.Tensor]:
    """The sums of already-reduced gradients, one per device that holds some, on ``device``."""
    by_device: dict[str, list[tf.Tensor]] = {}
    for g in reduced:
        value = g.values if isinstance(g, tf.IndexedSlices) else g
        by_device.setdefault(value.device, []).append(value)
    sums = []
    for where, values in by_device.items():
        with tf.device(where):
            parts = [tf.cast(tf.reduce_sum(v), tf.float32) for v in values]
            sums.append(send(tf.add_n(parts) if len(parts) > 1 else parts[0], device,
                             note="guard"))  # fmt: skip
    return sums


def sums_exactly(algorithm: Any, placement: str) -> bool:
    """The step's reduction adds every tower's elements with IEEE additions into each
    output it hands the optimizers, and keeps no state, so a NaN or Inf in any tower's
    gradient is one in every output: the library's own all-reduces built on copies
    (the registry's, not a user's registered one, nor collective ops), and ``sharded``'s
    ring reduce-scatter. Not a user's callable, a codec, a bucketed or stateful reducer.
    """
    if placement == "sharded":
        return True
    record = record_of(algorithm)
    module = str(getattr(record.algorithm.factory, "__module__", "") or "") if record else ""
    if record is None or algorithm_kind(algorithm) not in ("ring", "registered") \
            or not module.startswith("towers."):
        return False
    # a library algorithm built from parts (hierarchical's inner and outer) is exact
    # only when its parts are: a part may be a user's callable or registered name
    parts = [v for v in record.params.values() if callable(v)
             or (isinstance(v, str) and v in ALGORITHMS)]
    return all(sums_exactly(ALGORITHMS[p]() if isinstance(p, str) else p, placement)
               for p in parts)  # fmt: skip


def gather_codes(towers: Sequence[Any], devices: Sequence[str], device: str,
                 reduced: Sequence | None = None, central: bool = False) -> tf.Tensor:
    """Every tower's :func:`tower_code`, stacked on ``device``: zeros when every tower's
    :func:`tower_sum` (formed on its device, 4 bytes sent) adds up to a finite total,
    else each code formed elementwise on its tower (one ``tf.cond`` for the whole step).

    Args:
        towers: each tower's result (``loss``, ``grads``, ``non_trainable``), in tower order.
        devices: the towers' devices.
        device: where the decision is taken.
        reduced: one copy of every reduced gradient element, when the all-reduce adds
            every tower's elements with IEEE additions (:func:`sums_exactly`): a NaN or
            Inf in any tower's gradient is then a NaN or Inf there, so its sum stands in
            for the towers' gradients in the fast path (read once, not once per tower).
            On doubt the codes are still formed from each tower's own values.
        central: form every check on ``device``, from values handed there (a nested
            update on CPUs: :class:`~towers.compile.step.PhasedStep`);
            each tower's 4 bytes are still recorded as sent from its device, the traffic
            of the step as a model of separate devices.
    """
    sums = []
    for r, tower_device in zip(towers, devices):
        with tf.device(device if central else tower_device):
            grads = r.grads if reduced is None else ()
            flag = tower_sum(r.loss, grads, r.non_trainable)
        if not central:
            sums.append(send(flag, device, note="guard"))
            continue
        src, dst = canonical_device(tower_device), canonical_device(device)
        if src != dst:  # formed here already: record what a tower's own check would send
            log_send(flag, src, dst, None, None, "guard")
        sums.append(flag)
    if reduced is not None:
        sums += _reduced_sums(reduced, device)
    with tf.device(device):
        total = tf.add_n(sums) if len(sums) > 1 else sums[0]

    def exact() -> tf.Tensor:
        codes = []
        for r, tower_device in zip(towers, devices):
            with tf.device(device if central else tower_device):
                code = tower_code(r.loss, r.grads, r.non_trainable)
            with tf.device(device):
                # identity, not send(): the branch runs on doubt only; the traffic a step
                # is recorded with is the fast path's 4 bytes per tower
                codes.append(tf.identity(code))
        with tf.device(device):
            return tf.stack(codes)

    with tf.device(device):
        return tf.cond(tf.math.is_finite(total), lambda: tf.zeros([len(towers)], tf.int32), exact)


def _resource(v: Any) -> tf.Variable:
    """The ``tf.Variable`` behind a Keras variable (or ``v`` itself)."""
    inner = getattr(v, "value", v)
    return inner if isinstance(inner, tf.Variable) else v


def _count(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """How many towers' codes have any of ``bits`` (float32: summed across processes)."""
    return tf.reduce_sum(tf.cast(tf.not_equal(tf.bitwise.bitwise_and(codes, bits), 0), tf.float32))


class Guard:
    """A trainer's guard: its mode, and what the steps it ran have met.

    Args:
        mode: one of :data:`NONFINITE`.
        towers: the number of towers.
        device: where the decision is taken and the counters live (the parameter device).
        loss_scaled: the optimizer is a ``LossScaleOptimizer``: non-finite gradients
            are left to the dynamic scale (see the module docstring).
        agree: sums a float32 vector ``[towers that skip, towers whose gradients
            overflowed]`` over every process that steps together (a worker's trainer:
            all workers skip, raise or rescale together); None: this process decides alone.

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode: str, towers: int, device: str, loss_scaled: bool = False,
                 agree: Callable[[tf.Tensor], tf.Tensor] | None = None) -> None:
        check_choice("on_nonfinite", mode, NONFINITE)
        self.mode, self.device, self.loss_scaled, self.agree = mode, device, loss_scaled, agree
        # the code bits that skip (and raise): all of them, or all but the gradients'
        self.fatal = 7 & ~_GRADIENTS if loss_scaled else 7
        with tf.device(device):
            self.skipped = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_steps")
            self.codes = tf.Variable(tf.zeros([towers], tf.int32), trainable=False, name="codes")
            # the first variable whose update was non-finite, -1: none (on the last step)
            self.bad_update = tf.Variable(-1, dtype=tf.int32, trainable=False,
                                          name="bad_update")  # fmt: skip
        self._raised = 0  # skipped steps already raised for
        self._updated: list[str] = []  # the names of the variables the update check reads

    def run(self, towers: Sequence[Any], devices: Sequence[str], update: Callable[..., Any],
            reduced: Sequence | None = None, central: bool = False) -> Any:
        """``update(grads_finite)`` (reduce and apply; returns the loss) unless a tower
        met a NaN or Inf that skips the step.

        Args:
            towers: every tower's result (``loss``, ``grads``, ``non_trainable``), in
                tower order; tower ``i``'s values are on ``devices[i]``.
            devices: the towers' devices.
            update: the whole state-changing part of the step; it receives, when
                ``loss_scaled`` and checked, one boolean: every tower's gradients are
                finite (else None).
            reduced: the gradients already reduced by an all-reduce that
                :func:`sums_exactly` (one copy of each element), checked instead of the
                towers' gradients (see :func:`gather_codes`); ``update`` then only applies.
            central: check on the guard's device, from values handed there
                (:func:`gather_codes`).

        Returns:
            The loss ``update`` returns, or on a skipped step the towers' losses added
            in tower order (non-finite).
        """
        if self.mode == "ignore":
            return update(None)
        gathered = gather_codes(towers, devices, self.device, reduced, central)
        with tf.device(self.device):
            counts = tf.stack([_count(gathered, self.fatal), _count(gathered, _GRADIENTS)])
        if self.agree is not None:
            counts = self.agree(counts)
        with tf.device(self.device):
            ok = tf.equal(counts[0], 0.0)
            grads_ok = tf.equal(counts[1], 0.0) if self.loss_scaled else None

        def skip() -> tf.Tensor:
            with tf.device(self.device):
                self.skipped.assign_add(1)
                self.bad_update.assign(-1)  # the towers' values, not the update, were bad
                # identity, not send(): only one branch runs, its traffic is counted once
                return tf.add_n([tf.identity(r.loss) for r in towers])

        result = tf.cond(ok, functools.partial(update, grads_ok), skip)
        with tf.device(self.device):
            self.codes.assign(gathered)
        return result

    def applied(self, variables: Sequence[tf.Variable], apply: Callable[[], Any]) -> None:
        """``apply()``, then every variable as before it when an updated value is not
        finite (see the module docstring); ``"ignore"``: ``apply()`` alone.

        Args:
            variables: every variable the update may change (each once).
            apply: the update (inside :meth:`run`'s cond: it runs only on finite inputs).
        """
        if self.mode == "ignore":
            apply()
            return
        self._updated = [getattr(v, "path", None) or v.name for v in variables]
        variables = [_resource(v) for v in variables]
        before = [v.read_value() for v in variables]
        with tf.control_dependencies(before):
            apply()
        floating = [v for v in variables if v.dtype.is_floating]
        sums = []
        for v in floating:
            with tf.device(v.device):
                sums.append(tf.cast(tf.reduce_sum(v.read_value()), tf.float32))
        with tf.device(self.device):
            total = tf.add_n(sums) if len(sums) > 1 else sums[0] if sums else None

        def restore(bad: tf.Tensor) -> tf.Tensor:
            for v, old in zip(variables, before):
                with tf.device(v.device):
                    v.assign(old)
            with tf.device(self.device):
                self.bad_update.assign(bad)
                self.skipped.assign_add(1)
            return tf.constant(False)

        def kept() -> tf.Tensor:
            with tf.device(self.device):
                self.bad_update.assign(-1)
            return tf.constant(True)

        def exact() -> tf.Tensor:  # on doubt: finite values whose sum overflowed keep
            where = [i for i, v in enumerate(variables) if v.dtype.is_floating]
            with tf.device(self.device):
                finite = tf.stack([tf.reduce_all(tf.math.is_finite(variables[i].read_value()))
                                   for i in where])  # fmt: skip
                first = tf.gather(tf.constant(where, tf.int32),
                                  tf.argmin(tf.cast(finite, tf.int32)))  # fmt: skip
                return tf.cond(tf.reduce_all(finite), kept, lambda: restore(first))

        if not sums:
            return
        with tf.device(self.device):
            tf.cond(tf.math.is_finite(total), kept, exact)

    def raise_if_nonfinite(self, optimizer: Any, devices: Sequence[str]) -> None:
        """After a step: in ``"raise"`` mode, raise when the step was skipped — here, or
        on another process deciding together (then this one's towers may all be finite).

        Raises:
            NonFiniteError: naming the step and the towers (the step changed nothing).
        """
        if self.mode != "raise":
            return
        skipped, before = int(self.skipped.numpy()), self._raised
        self._raised = skipped
        if skipped > before:
            bad = int(self.bad_update.numpy())
            variable = self._updated[bad] if 0 <= bad < len(self._updated) else None
            raise NonFiniteError(int(optimizer.iterations), self.last(), devices, variable)

    def last(self) -> dict[int, list[str]]:
        """What made the last step skip, per tower (empty when it was not skipped; with
        loss scaling an overflowed gradient is the scale's business, not listed here)."""
        return describe(self.codes.numpy() & self.fatal) if self.mode != "ignore" else {}
