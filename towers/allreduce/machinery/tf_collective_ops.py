"""TensorFlow's collective ops as towers uses them: keys, ordering tokens, wire format, running.

Shared by :mod:`towers.allreduce.nccl` and :mod:`towers.cluster`. What TF 2.21 requires:
bfloat16 crosses all_gather and broadcast as float16 bits (:func:`wire`); empty tensors and
n = 1 never reach a collective (:func:`run`); every trace draws fresh keys (a reused key or
a timeout aborts every later collective); ``all_to_all_v2`` misroutes from 12 ranks
(:data:`MAX_ALL_TO_ALL`); one ordering token per device (:func:`token`).

References:
    TensorFlow ``cross_device_utils.CollectiveReplicaLauncher`` (ordering tokens, keys).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from towers.allreduce.machinery.base import as_written, check_values
from towers.allreduce.machinery.packed import per_tower
from towers.devices import canonical_device
from towers.guard.deadline import watched

__all__ = ["HINT", "KEY_START", "MAX_ALL_TO_ALL", "SHARED_KEY_START", "Body", "all_to_all",
           "broadcast_send_recv", "group_key", "next_key", "ranks", "run", "shared_keys", "token",
           "unwire", "wire"]

KEY_START = 10_000_000
"""First key of one process's collectives (tf.distribute's count from 1 and 1_000_000)."""
SHARED_KEY_START = 20_000_000
"""First key of collectives across processes (:func:`shared_keys`)."""
HINT = "nccl"
MAX_ALL_TO_ALL = 10
"""The largest group ``all_to_all_v2`` serves."""
Body = Callable[[list[tf.Tensor], tuple[str, ...], str], list[tf.Tensor]]
"""An algorithm's graph: ``body(values, devices, op) -> outputs``."""
_LOCK = threading.Lock()
_NEXT = [KEY_START]
_SHARED = [SHARED_KEY_START]
_GROUPS: dict[tuple[tuple[str, ...], int], int] = {}
_TOKENS: dict[str, tf.Variable] = {}
_EAGER: dict[tuple[object, ...], Callable[[list[tf.Tensor]], list[tf.Tensor]]] = {}
_LAST_BROADCAST: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def next_key() -> int:
    """A fresh collective key from the one process-wide, thread-safe counter."""
    with _LOCK:
        key = _NEXT[0]
        _NEXT[0] += 1
    return key


def group_key(devices: Sequence[str], size: int | None = None) -> int:
    """One group key per device set and size (fixed by the group's first use)."""
    members = (tuple(sorted(devices)), size or len(devices))
    with _LOCK:
        if members not in _GROUPS:
            _GROUPS[members] = _NEXT[0]
            _NEXT[0] += 1
        return _GROUPS[members]


def shared_keys(size: int) -> int:
    """The first of ``size`` consecutive keys for collectives across processes (draw
    them when a reducer or trainer is built, never while tracing)."""
    with _LOCK:
        first = _SHARED[0]
        _SHARED[0] += size
    return first


def token(device: str) -> tf.Tensor:
    """The device's one ordering token, shared by every collective on it."""
    name = canonical_device(device) or device
    with _LOCK:
        if name not in _TOKENS:
            with tf.init_scope(), tf.device(device):
                _TOKENS[name] = tf.Variable(0.0, trainable=False, name="ordering_token")
        return _TOKENS[name].handle


def wire(x: tf.Tensor) -> tf.Tensor:
    """``x`` as it crosses all_gather / broadcast: bfloat16 as its float16 bit pattern."""
    return tf.bitcast(x, tf.float16) if x.dtype == tf.bfloat16 else x


def unwire(x: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """Undo :func:`wire` for a tensor that was ``dtype`` before it."""
    return tf.bitcast(x, dtype) if dtype == tf.bfloat16 else x


def broadcast_send_recv(
    x: tf.Tensor, src: str, dsts: Sequence[str]
) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """TF's ``broadcast_send_v2`` of ``x`` (on ``src``) and a ``broadcast_recv_v2`` on each
    of ``dsts``; returns the send's output and the received tensors."""
    members = [src, *dsts]
    group, instance, size = group_key(members), next_key(), len(members)
    with tf.device(src), _after_previous(src) as chain:
        sent = collective_ops.broadcast_send_v2(
            wire(x), size, group, instance, communication_hint=HINT)
        chain(sent)
    received = []
    for dst in dsts:
        with tf.device(dst), _after_previous(dst) as chain:
            shape = tf.constant(x.shape.as_list(), tf.int32)
            got = collective_ops.broadcast_recv_v2(
                shape, wire(x).dtype, size, group, instance, communication_hint=HINT)
            chain(got)
            received.append(unwire(got, x.dtype))
    return unwire(sent, x.dtype), received


def all_to_all(rows: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """``rows[i]`` (``[n, chunk]`` on ``devices[i]``) sends its row ``j`` to rank ``j``
    (:func:`ranks`); output ``i`` holds, in rank order, the rows sent to its rank (above
    :data:`MAX_ALL_TO_ALL` ranks, by pairs in a round-robin tournament, :func:`_pairings`).
    """
    n = len(devices)
    if n <= MAX_ALL_TO_ALL:
        group, instance = group_key(devices), next_key()
        return per_tower(devices, lambda i: collective_ops.all_to_all_v2(
            rows[i], n, group, instance, communication_hint=HINT,
            ordering_token=token(devices[i])))
    rank = ranks(devices)
    got = per_tower(devices, lambda i: {rank[devices[i]]: rows[i][rank[devices[i]]]})
    sent: list[list[tf.Tensor]] = [[] for _ in devices]
    for a, b in (pair for rnd in _pairings(n) for pair in rnd):
        for src, dst in ((a, b), (b, a)):
            with tf.device(devices[src]):
                row = rows[src][rank[devices[dst]]]
            out, (got[dst][rank[devices[src]]],) = broadcast_send_recv(
                row, devices[src], [devices[dst]])
            sent[src].append(out)
    outputs = []
    for i, device in enumerate(devices):
        # The sends are nobody's input: the control edge keeps them from being pruned.
        with tf.device(device), tf.control_dependencies(sent[i]):
            outputs.append(tf.stack([got[i][r] for r in range(n)]))
    return outputs


def ranks(devices: Sequence[str]) -> dict[str, int]:
    """Each device's rank in a collective, as TensorFlow orders a group: by job, task and
    device index (``CPU:10`` after ``CPU:9``)."""
    def key(device: str) -> tuple[str, int, int, str]:
        spec = tf.DeviceSpec.from_string(device)
        return spec.job or "", spec.task or 0, spec.device_index or 0, device

    return {d: r for r, d in enumerate(sorted(devices, key=key))}


def _pairings(n: int) -> list[list[tuple[int, int]]]:
    """A round-robin tournament of ``n`` players (the circle method): every pair meets once."""
    m = n + n % 2  # a ghost player m - 1 >= n makes the count even
    rounds = []
    for k in range(m - 1):
        pairs = [(k, m - 1)] + [((k + i) % (m - 1), (k - i) % (m - 1)) for i in range(1, m // 2)]
        rounds.append([(min(p), max(p)) for p in pairs if max(p) < n])
    return rounds


@contextlib.contextmanager
def _after_previous(device: str) -> Iterator[Callable[[tf.Tensor], None]]:
    """A control edge from ``device``'s previous broadcast op in this graph (broadcasts must
    start in the same order on every device, or two wait on each other)."""
    if tf.executing_eagerly():
        yield lambda _: None
        return
    graph = tf.compat.v1.get_default_graph()
    last = _LAST_BROADCAST.setdefault(graph, {})
    previous = last.get(device)
    with tf.control_dependencies([previous] if previous is not None else []):

        def remember(t: tf.Tensor) -> None:
            last[device] = t.op

        yield remember


def run(body: Body, values: Sequence[tf.Tensor], op: str, timeout: float) -> list[tf.Tensor]:
    """Run ``body`` in the caller's graph or, eagerly, in a cached one within ``timeout``
    seconds (else ``tf.errors.DeadlineExceededError``)."""
    devices, shape = tuple(check_values(values, op)), values[0].shape
    if not shape.is_fully_defined():
        raise ValueError(f"the nccl algorithms need a fully defined static shape, got {shape}")
    # Nothing to exchange (and empty tensors crash all_gather/all_to_all/broadcast).
    trivial = len(values) == 1 or shape.num_elements() == 0
    if not trivial and not tf.executing_eagerly():
        return body(list(values), devices, op)
    results = values
    if not trivial:
        key = (body, devices, op, tuple(shape), values[0].dtype)
        with _LOCK:
            if key not in _EAGER:  # static Python control flow: no autograph
                _EAGER[key] = tf.function(lambda vals: body(vals, devices, op), autograph=False)
            fn = _EAGER[key]
        message = f"towers: a collective did not complete within {timeout:g} s"
        # as every towers reduction: a mean is the sum divided by n, not x·fl(1/n)
        with as_written(), watched(timeout, message) as alarm:
            try:
                results = fn(list(values))
            except tf.errors.CancelledError:  # a node cancelled beside the aborted collective
                if not alarm.fired:
                    raise
                raise tf.errors.DeadlineExceededError(None, None, message) from None
    # A tf.function's CPU outputs come back labelled with the caller's device: re-place them.
    return per_tower(devices, lambda i: tf.identity(results[i]))
