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
When the all-reduce sums exactly (:func:`~towers.guard.capabilities.sums_exactly`), it
runs *before* the cond and the fast path sums one copy of the reduced gradients. The flag
is formed from local values, so a lossy reducer cannot hide a NaN; reducer state is inside
the cond. Across processes (``WorkerTrainer``) the count is summed first: all skip or
apply together. A skipped step changes nothing but the guard's counters. The modes
(``on_nonfinite``: skip, raise, ignore) give bitwise the same result on finite steps.

The update is checked too (:meth:`Guard.applied`): finite gradients can still make a
non-finite update (SGD overflowing; Adam with ``epsilon=0``); then every variable gets
its old value back in one ``tf.cond``. With a ``LossScaleOptimizer`` a non-finite
*gradient* is the dynamic scale's (:mod:`towers.guard.loss_scale`): bit 2 becomes the
step's "gradients finite" flag; a non-finite loss or state still follows the mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.primitives import log_send, send
from towers.devices import canonical_device
from towers.guard.errors import NonFiniteError

__all__ = ["NONFINITE", "Guard", "describe", "gather_codes", "tower_code", "tower_sum"]

NONFINITE = ("skip", "raise", "ignore")
_WHAT = ((1, "loss"), (2, "gradients"), (4, "non-trainable state"))
_GRADIENTS = 2


def tower_code(loss: tf.Tensor, grads: Sequence, state: Sequence[tf.Tensor]) -> tf.Tensor:
    """One tower's int32 code: 0 when finite, else a sum of 1 (loss), 2 (gradients), 4 (state).

    Elementwise and branch-free, formed only on doubt (:func:`gather_codes`). Sparse
    gradients are checked through their values; integer state is not read.
    """
    dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    floating = [v for v in state if v.dtype.is_floating]
    code = tf.constant(0, tf.int32)
    for (bit, _), values in zip(_WHAT, ([loss], dense, floating)):
        # one is_finite pass per value: a boolean tensor as large as it (only on doubt)
        flags = [tf.reduce_all(tf.math.is_finite(v)) for v in values]
        finite = tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)
        code += tf.where(finite, 0, bit)
    return code


def describe(codes: np.ndarray) -> dict[int, list[str]]:
    """``{tower: ["loss", "gradients", …]}`` for every tower whose code is not 0."""
    return {i: [what for bit, what in _WHAT if int(c) & bit]
            for i, c in enumerate(np.asarray(codes).tolist()) if c}


def tower_sum(loss: tf.Tensor, grads: Sequence, state: Sequence[tf.Tensor]) -> tf.Tensor:
    """One tower's float32 proof: finite ⇒ its loss, gradients and state are all finite
    (``x + Inf`` is Inf or NaN, ``x + NaN`` is NaN, in any order). One reduction per
    value and one ``add_n``, no branch. A non-finite result may be an overflow of finite
    values; :func:`gather_codes` then lets the elementwise :func:`tower_code` decide.
    """
    dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    values = [loss, *dense, *(v for v in state if v.dtype.is_floating)]
    sums = [tf.cast(tf.reduce_sum(v), tf.float32) for v in values]
    return tf.add_n(sums) if len(sums) > 1 else sums[0]


def gather_codes(towers: Sequence[Any], devices: Sequence[str], device: str,
                 reduced: Sequence | None = None, central: bool = False) -> tf.Tensor:
    """Every tower's :func:`tower_code`, stacked on ``device``: zeros when every tower's
    :func:`tower_sum` (formed on its device, 4 bytes sent) adds up to a finite total,
    else each code formed elementwise on its tower (one ``tf.cond`` for the whole step).

    Args:
        towers: each tower's result (``loss``, ``grads``, ``non_trainable``), in tower order.
        devices: the towers' devices.
        device: where the decision is taken.
        reduced: one copy of every reduced gradient element, when the all-reduce sums
            exactly: its sum stands in for the towers' gradients in the fast path.
        central: form every check on ``device``, from values handed there (a nested
            update on CPUs: :class:`~towers.compile.step.PhasedStep`); each tower's
            4 bytes are still recorded as sent from its device.
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
    by_device: dict[str, list[tf.Tensor]] = {}  # the reduced copy's sums, one per device
    for g in reduced or ():
        value = g.values if isinstance(g, tf.IndexedSlices) else g
        by_device.setdefault(value.device, []).append(value)
    for where, values in by_device.items():
        with tf.device(where):
            parts = [tf.cast(tf.reduce_sum(v), tf.float32) for v in values]
            sums.append(send(tf.add_n(parts) if len(parts) > 1 else parts[0], device,
                             note="guard"))  # fmt: skip
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
        return tf.cond(tf.math.is_finite(total),
                       functools.partial(tf.zeros, [len(towers)], tf.int32), exact)


class Guard:
    """A trainer's guard: its mode, and what the steps it ran have met.

    Args:
        mode: one of :data:`NONFINITE`.
        towers: the number of towers.
        device: where the decision is taken and the counters live (the parameter device).
        loss_scaled: the optimizer is a ``LossScaleOptimizer`` (non-finite gradients
            are the dynamic scale's).
        agree: sums ``[towers that skip, towers whose gradients overflowed]`` (float32)
            over every process stepping together; None: this process decides alone.
    """

    def __init__(self, mode: str, towers: int, device: str, loss_scaled: bool = False,
                 agree: Callable[[tf.Tensor], tf.Tensor] | None = None) -> None:
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
        met a NaN or Inf that skips the step (then the towers' losses added, non-finite).

        Args:
            towers: every tower's result (``loss``, ``grads``, ``non_trainable``), in
                tower order; tower ``i``'s values are on ``devices[i]``.
            devices: the towers' devices.
            update: the whole state-changing part of the step; it receives, when
                ``loss_scaled`` and checked, one boolean: every tower's gradients are
                finite (else None).
            reduced, central: as for :func:`gather_codes`.
        """
        if self.mode == "ignore":
            return update(None)
        gathered = gather_codes(towers, devices, self.device, reduced, central)
        with tf.device(self.device):  # towers with a fatal bit, with a gradient bit (float32:
            # summed across processes)
            counts = tf.stack([
                tf.reduce_sum(tf.cast(tf.not_equal(tf.bitwise.bitwise_and(gathered, bits), 0),
                                      tf.float32))
                for bits in (self.fatal, _GRADIENTS)])
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

    def applied(self, rows: Sequence[Sequence[tf.Variable]], apply: Callable[[], Any]) -> None:
        """``apply()`` (the update, inside :meth:`run`'s cond), then every variable it may
        change as before it when an updated value is not finite; ``"ignore"``: ``apply()``
        alone.

        ``rows``: each variable the update may change, once, with its copies: equal before
        the update and after it (the same update of the same values), so the first copy
        alone is kept and checked, and every copy restored from it. Keeping a value across
        the update copies its buffer; one copy per row keeps that cost to one replica's.
        """
        if self.mode == "ignore":
            apply()
            return
        self._updated = [getattr(row[0], "path", None) or row[0].name for row in rows]
        # the tf.Variable behind a Keras variable
        rows = [[v.value if isinstance(getattr(v, "value", None), tf.Variable) else v
                 for v in row] for row in rows]  # fmt: skip
        before = [row[0].read_value() for row in rows]
        with tf.control_dependencies(before):
            apply()
        where = [i for i, row in enumerate(rows) if row[0].dtype.is_floating]
        if not where:
            return
        sums = []
        for i in where:
            with tf.device(rows[i][0].device):
                sums.append(tf.cast(tf.reduce_sum(rows[i][0].read_value()), tf.float32))
        with tf.device(self.device):
            total = tf.add_n(sums) if len(sums) > 1 else sums[0]

        def restore(bad: tf.Tensor) -> tf.Tensor:
            for row, old in zip(rows, before):
                for v in row:
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
            with tf.device(self.device):
                finite = tf.stack([tf.reduce_all(tf.math.is_finite(rows[i][0].read_value()))
                                   for i in where])  # fmt: skip
                first = tf.gather(tf.constant(where, tf.int32),
                                  tf.argmin(tf.cast(finite, tf.int32)))  # fmt: skip
                return tf.cond(tf.reduce_all(finite), kept, functools.partial(restore, first))

        with tf.device(self.device):
            tf.cond(tf.math.is_finite(total), kept, exact)

    def raise_if_nonfinite(self, optimizer: Any, devices: Sequence[str]) -> None:
        """After a step, in ``"raise"`` mode: :class:`NonFiniteError` naming the step and
        the towers when it was skipped, here or on another process deciding together."""
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
