"""The capability table, proved cell by cell: every combination works or is refused.

For a combination of ``TowerTrainer`` options (:mod:`towers.guard.capabilities`):

- **refused** — construction raises a ``ValueError`` naming both options, before the
  model factory ever runs (so no replica, variable or reducer state exists);
- **works** — two steps (some towers empty) equal the combination's reference:
  * exact sums (ring, registered, collective, bucketed, a user's): the same options
    with ``all_reduce="naive"`` (``replicated`` for ``sharded``), teacher-forced from the
    same weights, within :func:`towers.testing.sgd_step_bound` per step (a different
    summation order; depth ≤ n − 1 for every correct algorithm);
  * lossy codecs: the same codec over the same wire under the *other* placement,
    bitwise (the codec's own error is proved in tests/allreduce/test_compressed.py);
  and every replica stays bitwise identical; a step that fails in one tower (a label out
  of range) changes nothing (collective-op rows excepted: a failed collective aborts the
  process's later collectives; jit_compile rows too: XLA does not check labels); then a
  step with a NaN sample weight changes nothing —
  weights, slots, ``iterations``, loss scale and reducer state — under ``skip``/``raise``
  (``raise`` raises ``NonFiniteError``); under ``ignore`` the step is applied
  (``iterations`` advances) unless a ``LossScaleOptimizer`` skips it, which then halves its
  scale and changes nothing else.

``test_every_allowed_pair_works`` runs a pairwise covering set (every allowed pair of
values on two axes appears in some row), ``test_every_refused_cell_is_refused`` every
refused cell, and ``test_any_combination`` draws from the whole product with
Hypothesis (``examples(ci=4)``; 8× under ``--profile thorough``).

``reduce_dtype="compute"`` on these float32 models sums in float32 (the compute dtype):
the cell is exercised for composition; its mixed-precision numerics are
tests/test_mixed_precision.py's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, note, settings
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES, examples
from towers.allreduce.codecs import topk
from towers.allreduce.powersgd import powersgd
from towers.guard import capabilities
from towers.guard.capabilities import AXES, COLLECTIVE_OPS, REFUSALS, refusal_for
from towers.testing import ModelSpec, loss_fn, per_tower_gradients, sgd_step_bound

LR = 0.1
STEP_AXES = ("variables", "all_reduce", "optimizer", "on_nonfinite", "reduce_dtype", "sparse",
             "step_timeout", "semantics", "check_replicas_every", "check_algorithm",
             "loss_denominator", "forward_graph", "jit_compile", "batch_norm")
"""The axes a ``TowerTrainer`` takes (trainer kinds are tests/cluster's)."""
TOWER_KINDS = tuple(k for k in AXES["all_reduce"] if k != "cross-worker")
REGISTERED = tuple(sorted(n for n in towers.ALGORITHMS if n not in (*COLLECTIVE_OPS, "ring")))
FAMILIES = ("dense", "embedding", "regularized", "batchnorm")
LOSSY = ("compressed", "compressed+state")
DENOMINATORS: dict[str, Any] = {"semantics": None, "global": "global", "constant": 16}
"""A ``loss_denominator`` argument per axis value (the reference takes the same one)."""


def user_all_reduce(values: list[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """A user's algorithm with no registry record: every tower adds all values itself."""
    out = []
    for value in values:
        with tf.device(value.device):
            out.append(tf.add_n([tf.identity(v) for v in values]))
    return out


def make_all_reduce(kind: str, k: int) -> Any:
    """A fresh ``all_reduce`` argument of ``kind`` (variant ``k``: names and codecs cycle)."""
    if kind == "ring":
        return "ring"
    if kind == "registered":
        return REGISTERED[k % len(REGISTERED)]
    if kind == "collective":
        return COLLECTIVE_OPS[k % len(COLLECTIVE_OPS)]
    if kind == "bucketed":
        return towers.bucketed(("ring", "naive")[k % 2], 64)
    if kind == "compressed":
        return towers.compressed(("ring", "naive")[k % 2], ("fp16", "bf16")[k % 2])
    if kind == "compressed+state":
        return towers.compressed(("ring", "naive")[k % 2], (topk(0.5), powersgd(rank=1))[k % 2])
    if kind == "user":
        return user_all_reduce
    raise ValueError(kind)


def _optimizer(kind: str) -> Callable[[], keras.optimizers.Optimizer]:
    if kind == "loss_scale":
        return lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR))
    return lambda: keras.optimizers.SGD(LR)


def build(options: dict[str, str], k: int, spec: ModelSpec, n: int,
          model: Callable[[], keras.Model] | None = None, **overrides: Any) -> towers.TowerTrainer:
    """The ``TowerTrainer`` of ``options`` (``overrides`` replace arguments)."""
    kwargs: dict[str, Any] = dict(
        devices=DEVICES[:n], variables=options["variables"],
        all_reduce=make_all_reduce(options["all_reduce"], k),
        on_nonfinite=options["on_nonfinite"], reduce_dtype=options["reduce_dtype"],
        sparse=options["sparse"],
        step_timeout=None if options["step_timeout"] == "off" else 120.0,
        semantics=options["semantics"],
        check_replicas_every=None if options["check_replicas_every"] == "off" else 1,
        check_algorithm=options["check_algorithm"] == "on",
        loss_denominator=DENOMINATORS[options["loss_denominator"]],
        forward_graph=options["forward_graph"],
        jit_compile=options["jit_compile"] == "on",
    )  # fmt: skip
    kwargs.update(overrides)
    model = model or spec.build
    if options.get("batch_norm") == "synchronized":  # the model's axis, not an argument
        model = _synchronized(model)
    return towers.TowerTrainer(model, _optimizer(options["optimizer"])(), loss_fn(),
                               **kwargs)  # fmt: skip


def _synchronized(build: Callable[[], keras.Model]) -> Callable[[], keras.Model]:
    """``build``'s model with every BatchNormalization ``synchronized=True``."""

    def make() -> keras.Model:
        model = build()
        for layer in model._flatten_layers(include_self=False, recursive=True):
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = True
        return model

    return make


def _state(trainer: towers.TowerTrainer) -> dict[str, np.ndarray]:
    """Every variable a step may change: each replica's weights and optimizer variables
    (slots, ``iterations``, loss scale) and the reducer's state."""
    out: dict[str, np.ndarray] = {}
    for r, replica in enumerate(trainer.replicas):
        for v in replica.model.weights:
            out[f"replica {r}: {v.path}"] = np.array(v.numpy())
        for j, v in enumerate(replica.optimizer.variables):
            out[f"replica {r}: optimizer {j} {v.path}"] = np.array(v.numpy())
    module = trainer.reducer.dense
    for j, v in enumerate(getattr(module, "variables", ()) if module is not None else ()):
        out[f"reducer {j} {v.name}"] = np.array(v.numpy())
    return out


def _assert_unchanged(before: dict[str, np.ndarray], after: dict[str, np.ndarray],
                      skip: Callable[[str], bool] = lambda name: False) -> None:
    changed = [k for k in before
               if not skip(k) and not np.array_equal(before[k], after[k], equal_nan=True)]
    assert not changed, f"a skipped step changed {changed}"


def _trainable(trainer: towers.TowerTrainer) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in trainer.model.trainable_variables]


def _assert_replicas_identical(trainer: towers.TowerTrainer) -> None:
    copies = trainer.replica_weights()
    for r, weights in enumerate(copies[1:], 1):
        for j, (a, b) in enumerate(zip(copies[0], weights)):
            assert np.array_equal(a, b), f"replica {r} drifted from replica 0 in weight {j}"


def _reference(options: dict[str, str], k: int, spec: ModelSpec, n: int) -> towers.TowerTrainer:
    if options["all_reduce"] in LOSSY:  # same codec and wire, the other placement: bitwise
        other = "parameter_device" if options["variables"] == "replicated" else "replicated"
        return build(options, k, spec, n, variables=other, step_timeout=None)
    variables = "replicated" if options["variables"] == "sharded" else options["variables"]
    return build(options, k, spec, n, variables=variables, all_reduce="naive", step_timeout=None)


def _batch(spec: ModelSpec, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    return spec.batch(size, seed=seed)


def _heavier(options: dict[str, str], size: int, n: int) -> float:
    """How much heavier a tower's loss may weigh under ``loss_denominator`` than over the
    global batch (``per_tower_gradients`` divides by it): the bound's Σ|g_i| scales by it."""
    rule = DENOMINATORS[options["loss_denominator"]]
    if rule is None:  # the semantics' divisor
        rule = "per_replica" if options["semantics"] == "mirrored" else "global"
    if rule == "global":
        return 1.0
    smallest = size // n or 1  # per_replica: the smallest non-empty shard × n towers
    divisor = rule if rule != "per_replica" else smallest * n
    return max(1.0, size / divisor)


def _tower_gradients(trainer: towers.TowerTrainer, options: dict[str, str], x: np.ndarray,
                     y: np.ndarray, n: int) -> list[list[np.ndarray]]:
    """Each tower's gradient, to size the bound: a synchronized BatchNormalization's
    comes from the trainer's own towers, which meet (alone, a tower's gradient of a bias
    before it is ~0, and would bound the sum of the synchronized ones by 0)."""
    if options.get("batch_norm") != "synchronized":
        return per_tower_gradients(trainer.model, x, y, DEVICES[:n])
    phases = tf.function(lambda a, b: trainer.forward_backward(trainer.split(a, b)).grads)
    return [[np.asarray(tf.convert_to_tensor(g)) for g in tower] for tower in phases(x, y)]


def check_works(options: dict[str, str], k: int, spec: ModelSpec, n: int) -> None:
    """Two steps equal the reference; replicas identical; a NaN step changes nothing."""
    trainer, reference = build(options, k, spec, n), _reference(options, k, spec, n)
    lossy = options["all_reduce"] in LOSSY
    for step, size in enumerate((max(1, n - 1), n + 2)):  # n - 1 leaves a tower empty
        x, y = _batch(spec, size, seed=step)
        if not lossy:
            reference.set_weights(trainer.get_weights())  # teacher forcing: same start
        start = _trainable(trainer)
        grads = _tower_gradients(trainer, options, x, y, n)
        grads = [[g * _heavier(options, size, n) for g in tower] for tower in grads]
        ours, theirs = trainer.train_step(x, y), reference.train_step(x, y)
        bound = [np.zeros_like(w) for w in start] if lossy else sgd_step_bound(
            start, grads, LR, depth=max(1, n - 1))
        for j, (a, b, tol) in enumerate(zip(_trainable(trainer), _trainable(reference), bound)):
            err = np.abs(a.astype(np.float64) - b)
            assert np.all(err <= tol), (f"step {step} weight {j}: max err {err.max():.3g} over "
                                        f"bound {np.max(tol):.3g}")
        if lossy:
            assert float(ours) == float(theirs)
        _assert_replicas_identical(trainer)
    # XLA does not check a label's range (an out-of-range label gives a NaN loss, which
    # the non-finite check below covers), so under jit_compile no tower fails with an error
    if options["all_reduce"] != "collective" and options["jit_compile"] == "off":
        _check_failed_step(trainer, spec, n)
    _check_nonfinite_step(trainer, options, spec, n)


def _check_failed_step(trainer: towers.TowerTrainer, spec: ModelSpec, n: int) -> None:
    """A step that fails in its last tower (a label out of range: TensorFlow's own error)
    changes nothing. Not for collective ops: a failed collective step aborts every later
    collective in the process (tests/guard/test_tower_error.py, test_deadline.py). The
    batch has the second step's size: the traced step is the one that ran, not a new one."""
    x, y = _batch(spec, n + 2, seed=7)
    y = y.copy()
    y[-1] = spec.classes  # out of range for the last tower's shard
    before = _state(trainer)
    with pytest.raises(tf.errors.InvalidArgumentError):
        trainer.train_step(x, y)
    _assert_unchanged(before, _state(trainer))


def _check_nonfinite_step(trainer: towers.TowerTrainer, options: dict[str, str],
                          spec: ModelSpec, n: int) -> None:
    x, y = _batch(spec, n + 1, seed=9)
    weight = np.ones(len(x), "float32")
    weight[-1] = np.nan  # the last tower's loss and gradients are NaN
    before = _state(trainer)
    mode, scaled = options["on_nonfinite"], options["optimizer"] == "loss_scale"
    scale = float(trainer.optimizer.dynamic_scale.numpy()) if scaled else 0.0
    if mode == "raise":
        with pytest.raises(towers.NonFiniteError):
            trainer.train_step(x, y, weight)
    else:
        trainer.train_step(x, y, weight)
    after = _state(trainer)
    if mode != "ignore":
        _assert_unchanged(before, after)
        assert trainer.skipped_steps == 1
    elif scaled:  # the LossScaleOptimizer skips it: only its scale moves (halved)
        _assert_unchanged(before, after, skip=lambda name: "dynamic_scale" in name
                          or "step_counter" in name)
        assert float(trainer.optimizer.dynamic_scale.numpy()) == scale / 2
    else:  # applied, as tf.distribute would
        assert int(trainer.optimizer.iterations.numpy()) == 3


def check_refused(options: dict[str, str], spec: ModelSpec, n: int) -> None:
    """Construction raises naming both options, before the model factory runs."""
    refusal = refusal_for(options)
    assert refusal is not None
    calls: list[int] = []

    def counting() -> keras.Model:
        calls.append(1)
        return spec.build()

    with pytest.raises(ValueError) as err:
        build(options, 0, spec, n, model=counting)
    (a, _), (b, _) = refusal.first, refusal.second
    assert f"{a}=" in str(err.value) and f"{b}=" in str(err.value) and "refused" in str(err.value)
    assert calls == [], "the model factory ran before the combination was refused"


def check(options: dict[str, str], k: int, family: str, n: int) -> None:
    if options.get("batch_norm") == "synchronized":
        family = "batchnorm"  # the family with a BatchNormalization to synchronize
    spec = ModelSpec(family)
    if (options["all_reduce"] == "collective" or family == "batchnorm") and n == 1:
        n = 2  # nothing reaches a collective op at one tower: make the cell mean something
    if refusal_for({"trainer": "TowerTrainer", **options}) is not None:
        check_refused({"trainer": "TowerTrainer", **options}, spec, n)
    else:
        check_works(options, k, spec, n)


def _allowed(row: dict[str, str]) -> bool:
    return refusal_for({"trainer": "TowerTrainer", **row}) is None


def covering_rows() -> list[dict[str, str]]:
    """A small set of allowed rows in which every allowed pair of values appears (greedy)."""
    values = [TOWER_KINDS if a == "all_reduce" else AXES[a] for a in STEP_AXES]
    rows = [dict(zip(STEP_AXES, combo)) for combo in itertools.product(*values)]
    rows = [r for r in rows if _allowed(r)]

    index: dict[tuple[str, str, str, str], int] = {}

    def pairs(row: dict[str, str]) -> int:  # the row's pairs of values as bits of one int
        bits = 0
        for a, b in itertools.combinations(STEP_AXES, 2):
            bits |= 1 << index.setdefault((a, row[a], b, row[b]), len(index))
        return bits

    masks = [pairs(r) for r in rows]
    todo, chosen = (1 << len(index)) - 1, []
    while todo:
        best = max(range(len(rows)), key=lambda i: (masks[i] & todo).bit_count())
        chosen.append(rows[best])
        todo &= ~masks[best]
    return chosen


COVER = covering_rows()


@pytest.mark.long
@pytest.mark.parametrize("k", range(len(COVER)), ids=lambda k: "-".join(COVER[k].values()))
def test_every_allowed_pair_works(k: int) -> None:
    check(COVER[k], k, FAMILIES[k % len(FAMILIES)], 1 + k % 8)


def _refused_cells() -> list[dict[str, str]]:
    cells = []
    for refusal in REFUSALS:
        (a, va), (b, vb) = refusal.first, refusal.second
        if "trainer" in (a, b) or "batch_norm" in (a, b):
            continue  # another trainer kind: tests/cluster; a layer: tests/training
        for x, y in itertools.product(va, vb):
            if "cross-worker" in (x, y):
                continue  # not a TowerTrainer's (refused with trainer= above)
            base = {"variables": "replicated", "all_reduce": "ring", "optimizer": "plain",
                    "on_nonfinite": "skip", "reduce_dtype": "float32", "sparse": "gather",
                    "step_timeout": "off", "semantics": "one_device",
                    "check_replicas_every": "off", "check_algorithm": "on",
                    "loss_denominator": "semantics", "forward_graph": "default",
                    "jit_compile": "off"}
            cells.append({**base, a: x, b: y})
    return cells


REFUSED = _refused_cells()


@pytest.mark.parametrize("k", range(len(REFUSED)), ids=lambda k: "-".join(REFUSED[k].values()))
def test_every_refused_cell_is_refused(k: int) -> None:
    check_refused({"trainer": "TowerTrainer", **REFUSED[k]}, ModelSpec("dense"), 1 + k % 8)


def test_covering_rows_cover_every_allowed_pair() -> None:
    """Every pair of values the refusals do not name is in some covering row; no covering
    row is refused; every refusal has cells (so ✓ and ✗ together are the whole table)."""
    seen = {(a, r[a], b, r[b]) for r in COVER for a, b in itertools.combinations(STEP_AXES, 2)}
    missing = []
    for a, b in itertools.combinations(STEP_AXES, 2):
        va = TOWER_KINDS if a == "all_reduce" else AXES[a]
        vb = TOWER_KINDS if b == "all_reduce" else AXES[b]
        for x, y in itertools.product(va, vb):
            if refusal_for({"trainer": "TowerTrainer", a: x, b: y}) is None \
                    and (a, x, b, y) not in seen:
                missing.append((a, x, b, y))
    assert missing == []
    assert all(_allowed(r) for r in COVER)
    assert len(REFUSED) >= sum(1 for r in REFUSALS
                               if not {"trainer", "batch_norm"} & {r.first[0], r.second[0]})


@settings(max_examples=examples(ci=4))
@given(
    options=st.fixed_dictionaries(
        {a: st.sampled_from(TOWER_KINDS if a == "all_reduce" else AXES[a]) for a in STEP_AXES}
    ),
    k=st.integers(0, 11),
    family=st.sampled_from(FAMILIES),
    n=st.integers(1, 8),
)
def test_any_combination(options: dict[str, str], k: int, family: str, n: int) -> None:
    note(f"{options} variant {k}, {family}, {n} towers")
    check(options, k, family, n)


def test_the_options_page_shows_the_table() -> None:
    """docs/options.md's capability matrix is the table's own rendering (it cannot drift)."""
    with open("docs/options.md", encoding="utf-8") as f:
        page = f.read()
    assert capabilities.markdown() in page


def test_defaults_follow_the_placement() -> None:
    spec = ModelSpec("embedding")
    sharded = towers.TowerTrainer(spec.build, keras.optimizers.SGD(LR), loss_fn(),
                                  devices=DEVICES[:3], variables="sharded")  # fmt: skip
    assert (sharded.cell["all_reduce"], sharded.sparse) == ("ring", "densify")
    sharded.train_step(*spec.batch(5, seed=0))  # an Embedding trains without naming sparse
    replicated = towers.TowerTrainer(spec.build, keras.optimizers.SGD(LR), loss_fn(),
                                     devices=DEVICES[:3], variables="replicated")  # fmt: skip
    assert (replicated.cell["all_reduce"], replicated.sparse) == ("registered", "gather")
