"""Compressed all-reduce: each codec's documented error bound, state, checkpoints, training.

Tolerances, derived (u = 2^-24, γ_k = k·u/(1 − k·u); float64 references of at most 8
float32 terms add ≤ 8·2^-53 relative error, far below every bound here):

* fp16 / bf16: ``Cast.error_bound`` (derived in its docstring) with depth n − 1.
* top-k: no tolerance. The transmitted values are exact copies and the decoder adds
  them into zeros in tower order, which NumPy float32 replays bitwise; the residual
  is Δ with the sent entries zeroed, bitwise.
* PowerSGD: see the comments of the two PowerSGD property tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import assume, given
from hypothesis import strategies as st

import towers
from tests.allreduce.machinery.test_primitives import place
from tests.conftest import DEVICES
from towers.allreduce import naive, ring
from towers.allreduce.codecs import Cast, Identity, TopK, TopKState, bf16, fp16, identity, topk
from towers.allreduce.compressed import Compressed, compressed
from towers.allreduce.machinery.primitives import record
from towers.allreduce.powersgd import PowerSGD, orthogonalize, powersgd
from towers.devices import canonical_device
from towers.testing import gamma
from towers.training.data import batches, digits
from towers.training.models import digits_cnn

U = 2.0**-24
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (16, 8)]


def _grads(n: int, shapes: Sequence[tuple[int, ...]], seed: int, scale: float = 1.0
           ) -> list[list[tf.Tensor]]:
    """``grads[tower][var]``: float32 normals times ``scale`` on ``DEVICES[tower]``."""
    rng = np.random.default_rng(seed)
    per_var = [place([(rng.normal(size=s) * scale).astype(np.float32) for _ in range(n)])
               for s in shapes]
    return [[per_var[j][t] for j in range(len(shapes))] for t in range(n)]


def _built(codec: Any, shapes: Sequence[tuple[int, ...]], n: int, algorithm: Any = "ring",
           decode: str = "once") -> Compressed:
    reducer = compressed(algorithm, codec, decode=decode)
    reducer.build([tf.Variable(tf.zeros(s)) for s in shapes], DEVICES[:n])
    return reducer


def _values(outs: list[list[tf.Tensor]]) -> list[list[np.ndarray]]:
    """Every output as NumPy, after checking placement and bitwise agreement of the towers."""
    out = []
    for t, row in enumerate(outs):
        for j, x in enumerate(row):
            assert canonical_device(x.device) == DEVICES[t], f"tower {t} var {j}"
            assert x.numpy().tobytes() == outs[0][j].numpy().tobytes(), f"tower {t} var {j}"
        out.append([x.numpy() for x in row])
    return out


def _state(reducer: Compressed) -> list[list[list[np.ndarray]]]:
    """``state[tower][var][k]`` as NumPy."""
    return [[[v.numpy() for v in var] for var in row] for row in reducer.state]


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested lists of arrays."""
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


# --- fp16 / bf16 -----------------------------------------------------------------------------


@pytest.mark.parametrize("make", [fp16, bf16], ids=["fp16", "bf16"])
@given(
    n=st.integers(1, 8),
    shape=st.sampled_from(SHAPES),
    scale=st.sampled_from([1e-7, 1e-3, 1.0, 1e3]),  # 1e-7/n: float16 subnormals
    algorithm=st.sampled_from(["naive", "ring", "tree"]),
    decode=st.sampled_from(["once", "everywhere"]),
    seed=st.integers(0, 2**16),
)
def test_cast_codecs_stay_within_their_documented_bound(
    make: Any, n: int, shape: tuple[int, ...], scale: float, algorithm: str, decode: str,
    seed: int,
) -> None:
    grads = _grads(n, [shape], seed, scale)
    codec = make()
    got = _values(_built(codec, [shape], n, algorithm, decode).reduce_gradients(grads))
    xs = np.stack([g[0].numpy().astype(np.float64) for g in grads])
    bound = codec.error_bound(np.abs(xs).sum(0), n, depth=n - 1)
    for t in range(n):
        err = np.abs(got[t][0].astype(np.float64) - xs.sum(0))
        assert np.all(err <= bound), f"tower {t}: worst {np.max(err / bound, initial=0):.3g}×bound"


def test_fp16_divides_before_the_cast_so_the_sum_cannot_overflow() -> None:
    n = 4
    grads = [[x] for x in place([np.full(3, 60000.0, np.float32)] * n)]  # Σ = 240000 > 65504
    assert np.isinf(float(tf.cast(tf.constant(60000.0) * n, tf.float16)))  # sum first: inf
    (out,) = _values(_built(fp16(), [(3,)], n).reduce_gradients(grads))[0]
    bound = Cast(tf.float16).error_bound(4 * 60000.0, n, depth=n - 1)
    assert np.all(np.abs(out.astype(np.float64) - 240000.0) <= bound)


# --- top-k -----------------------------------------------------------------------------------


@given(shape=st.sampled_from(SHAPES), ratio=st.floats(0.01, 1.0), seed=st.integers(0, 2**16),
       ties=st.booleans())
def test_topk_sends_exact_values_and_keeps_exactly_what_it_dropped(
    shape: tuple[int, ...], ratio: float, seed: int, ties: bool
) -> None:
    rng = np.random.default_rng(seed)
    g = rng.normal(size=shape).astype(np.float32)
    e = rng.normal(size=shape).astype(np.float32)
    if ties:  # equal magnitudes: top_k breaks ties toward the lower index
        g, e = np.round(g).astype(np.float32), np.zeros(shape, np.float32)
    codec = TopK(ratio)
    (indices, values), state = codec.encode(tf.constant(g), TopKState(tf.constant(e)))
    delta = (g + e).reshape(-1)  # float32 + float32 in NumPy rounds as TF does
    k = codec.count(delta.size)
    assert k == (0 if delta.size == 0 else min(delta.size, max(1, math.ceil(ratio * delta.size))))
    order = np.argsort(-np.abs(delta), kind="stable")[:k]
    np.testing.assert_array_equal(indices.numpy(), order)
    assert values.numpy().tobytes() == delta[order].tobytes()  # sent exactly
    kept = np.zeros_like(delta)
    kept[order] = delta[order]
    residual = delta.copy()
    residual[order] = 0.0
    assert state.residual.numpy().tobytes() == residual.reshape(shape).tobytes()
    assert np.array_equal(kept + residual, delta)  # nothing lost: Δ = sent + kept back
    if 0 < k < delta.size:
        assert np.min(np.abs(values.numpy())) >= np.max(np.abs(residual))


@given(n=st.integers(1, 6), ratio=st.sampled_from([0.05, 0.3, 1.0]), seed=st.integers(0, 2**16),
       decode=st.sampled_from(["once", "everywhere"]))
def test_topk_sum_is_the_tower_order_scatter_add_of_what_was_sent(
    n: int, ratio: float, seed: int, decode: str
) -> None:
    shapes = [(3, 5), (7,), ()]
    reducer = _built(topk(ratio), shapes, n, decode=decode)
    residual = [[np.zeros(s, np.float32) for s in shapes] for _ in range(n)]
    for step in range(2):  # the second step adds the first step's residual
        grads = _grads(n, shapes, seed + step)
        got = _values(reducer.reduce_gradients(grads))
        for j, shape in enumerate(shapes):
            want = np.zeros(int(np.prod(shape)), np.float32)
            for t in range(n):
                delta = (grads[t][j].numpy() + residual[t][j]).reshape(-1)
                sent = np.argsort(-np.abs(delta), kind="stable")[: TopK(ratio).count(delta.size)]
                want[sent] += delta[sent]  # float32, in tower order: the decoder's order
                delta[sent] = 0.0
                residual[t][j] = delta.reshape(shape)
                assert reducer.state[t][j][0].numpy().tobytes() == residual[t][j].tobytes()
            assert got[0][j].tobytes() == want.reshape(shape).tobytes(), f"step {step} var {j}"


def test_topk_with_ratio_one_is_the_naive_sum() -> None:
    n, shapes = 4, [(3, 5), (7,)]
    grads = _grads(n, shapes, 0)
    got = _values(_built(topk(1.0), shapes, n).reduce_gradients(grads))
    for j in range(len(shapes)):
        # 0 + x0 + x1 + ... in tower order is add_n's order (only -0.0 may become +0.0)
        np.testing.assert_array_equal(got[0][j], naive([g[j] for g in grads])[0].numpy())


# --- PowerSGD --------------------------------------------------------------------------------


def _matrix_case(draw: Any) -> tuple[int, int, int, int]:
    """m × c, a rank r small enough to compress ((m + c)·r·2 < m·c), n towers."""
    m, c, n = draw(st.integers(6, 24)), draw(st.integers(6, 24)), draw(st.integers(1, 5))
    r = max(1, min(draw(st.integers(1, 3)), (m * c - 1) // (2 * (m + c))))
    assert PowerSGD(r).matrix((m, c)) == (m, c, r)
    return m, c, r, n


@given(data=st.data(), seed=st.integers(0, 2**16))
def test_powersgd_recovers_a_sum_of_rank_r_matrices(data: Any, seed: int) -> None:
    # Every M_t = A·B_tᵀ lies in the column space of A (m × r), so P = Σ M_t·Q spans it and
    # P̂P̂ᵀ·M_t = M_t: the error is rounding only. First-order perturbation bound: computing
    # P errs by ≤ (c + n)·u relative, which tilts span(P̂) by ≤ κ(P)·(c + n)·u; modified
    # Gram-Schmidt loses ≤ κ(P)·m·r·u of orthogonality; the products Q_t = Δ_tᵀP̂ and
    # P̂·Qᵀ add γ_m and γ_r. With a safety factor 10 for the constants:
    #     |out − Σ M_t| ≤ 10·(κ(P)·(m + c + n)·r + m + r + n)·u·Σ‖M_t‖_F.
    m, c, r, n = _matrix_case(data.draw)
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(m, r))
    reducer = _built(powersgd(r), [(m, c)], n)
    for step in range(2):  # step 2: Q warm-started from step 1, new B_t in the same span
        q0 = reducer.state[0][0][1].numpy().astype(np.float64)
        ms = [(a @ rng.normal(size=(c, r)).T).astype(np.float32) for _ in range(n)]
        got = _values(reducer.reduce_gradients([[x] for x in place(ms)]))
        exact = np.sum([x.astype(np.float64) for x in ms], axis=0)
        p = exact @ q0  # the exact P (errors are zero: step 1 leaves none, see below)
        kappa = np.linalg.cond(p)
        scale = sum(np.linalg.norm(x) for x in ms)
        tol = 10 * (kappa * (m + c + n) * r + m + r + n) * U * scale
        assert np.max(np.abs(got[0][0] - exact)) <= tol, f"step {step}"
        for t in range(n):  # the dropped part (error feedback) is rounding only, too
            assert np.max(np.abs(reducer.state[t][0][0].numpy())) <= tol, f"step {step} tower {t}"
        reducer = _zero_errors(reducer)


def _zero_errors(reducer: Compressed) -> Compressed:
    """Clear the (rounding-sized) residuals so the next step's input is exactly rank r."""
    for row in reducer.state:
        row[0][0].assign(tf.zeros_like(row[0][0]))
    return reducer


@given(data=st.data(), steps=st.integers(1, 3), seed=st.integers(0, 2**16),
       warm=st.booleans(), decode=st.sampled_from(["once", "everywhere"]))
def test_powersgd_error_feedback_keeps_what_was_dropped(
    data: Any, steps: int, seed: int, warm: bool, decode: str
) -> None:
    # Per step, with Δ_t = fl(M_t + e_t), D_t = fl(P̂·Q_tᵀ), e_t' = fl(Δ_t − D_t) and
    # out = fl(P̂·fl(Σ_t Q_t)ᵀ):  out + Σ_t e_t' − Σ_t Δ_t = P̂·E3ᵀ + E4 − Σ E1_t + Σ E2_t,
    # |E1_t| ≤ γ_r|P̂||Q_t|ᵀ, |E2_t| ≤ u|e_t'|, |E3| ≤ γ_{n-1}Σ|Q_t|, |E4| ≤ γ_r|P̂||ΣQ_t|ᵀ.
    # P̂ has unit columns, so |P̂_ai| ≤ 1 and |Q_t[j,i]| ≤ ‖Δ_t[:, j]‖₂ (Cauchy-Schwarz):
    #     |…|_aj ≤ 1.01·(γ_{n-1} + 2γ_r)·r·Σ_t‖Δ_t[:, j]‖₂ + 1.01·u·Σ_t|e_t'|_aj,
    # plus u·|Δ_t| for forming Δ_t. Summed over the steps, Σ out + Σ_t e_t(final) must
    # match Σ_steps Σ_t M_t within the summed bounds.
    m, c, r, n = _matrix_case(data.draw)
    reducer = _built(powersgd(r, warm_start=warm), [(m, c)], n, decode=decode)
    total_in = np.zeros((m, c))
    total_out = np.zeros((m, c))
    bound = np.zeros((m, c))
    for step in range(steps):
        grads = _grads(n, [(m, c)], seed + step)
        deltas = [g[0].numpy().astype(np.float64) + reducer.state[t][0][0].numpy()
                  for t, g in enumerate(grads)]
        got = _values(reducer.reduce_gradients(grads))
        errors = [np.abs(reducer.state[t][0][0].numpy().astype(np.float64)) for t in range(n)]
        cols = sum(np.linalg.norm(d, axis=0) for d in deltas)
        bound += 1.01 * (gamma(max(n - 1, 0)) + 2 * gamma(r)) * r * cols[None, :]
        bound += 1.01 * U * (sum(errors) + sum(np.abs(d) for d in deltas))
        total_in += sum(g[0].numpy().astype(np.float64) for g in grads)
        total_out += got[0][0]
    kept = sum(reducer.state[t][0][0].numpy().astype(np.float64) for t in range(n))
    assert np.all(np.abs(total_out + kept - total_in) <= bound)


def test_powersgd_shares_its_seed_and_warm_starts_q() -> None:
    n, shapes = 4, [(16, 8), (8,), (2, 2)]  # the vector and the tiny matrix: no state
    reducer = _built(powersgd(2, seed=5), shapes, n)
    first = _state(reducer)
    assert [len(s) for s in first[0]] == [3, 0, 0]
    drawn = tf.random.stateless_normal([8, 2], seed=tf.constant([5, 0], tf.int64)).numpy()
    for t in range(n):
        assert first[t][0][1].tobytes() == drawn.tobytes()  # the same Q on every tower
    other = _built(powersgd(2, seed=6), shapes, 1)
    assert not np.array_equal(_state(other)[0][0][1], drawn)
    grads = _grads(n, shapes, 0)
    with record() as rec:
        outs = _values(reducer.reduce_gradients(grads))
    after = _state(reducer)
    for t in range(n):  # warm start: the reduced Q, bitwise equal on every tower
        assert after[t][0][1].tobytes() == after[0][0][1].tobytes()
    assert not np.array_equal(after[0][0][1], drawn)
    for j in (1, 2):  # uncompressed tensors: exactly the algorithm's sum
        assert outs[0][j].tobytes() == ring()([g[j] for g in grads])[0].numpy().tobytes()
    # Tower 1 only runs the ring (2·3 chunks of ceil(size/4) floats): P 16×2, Q 8×2, the
    # vector and the 2×2 matrix; not the 16×8 matrix (768 bytes through the ring alone).
    assert rec.bytes_sent()[DEVICES[1]] == 2 * 3 * 4 * (8 + 4 + 2 + 1) == 360
    cold = _built(powersgd(2, warm_start=False, seed=5), shapes, n)
    cold.reduce_gradients(grads)
    fresh = _state(cold)
    assert all(fresh[t][0][1].tobytes() == fresh[0][0][1].tobytes() for t in range(n))
    assert not np.array_equal(fresh[0][0][1], drawn)


@given(m=st.integers(1, 30), r=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_orthogonalize_gives_orthonormal_columns_spanning_p(m: int, r: int, seed: int) -> None:
    # Modified Gram-Schmidt: ‖P̂ᵀP̂ − I‖ ≤ c·κ(P)·u (Björck 1967); c = 10·m·r is generous.
    assume(r <= m)
    p = np.random.default_rng(seed).normal(size=(m, r))
    got = orthogonalize(tf.constant(p, tf.float32)).numpy().astype(np.float64)
    kappa = np.linalg.cond(p)
    assert np.max(np.abs(got.T @ got - np.eye(r))) <= 10 * m * r * kappa * U
    coef = np.linalg.lstsq(got, p, rcond=None)[0]  # P = P̂·R: same column space
    assert np.max(np.abs(got @ coef - p)) <= 10 * m * r * kappa * U * np.abs(p).max()
    zero = orthogonalize(tf.zeros([m, r])).numpy()
    assert not np.isnan(zero).any() and not zero.any()


# --- the wrapper: decode modes, state, checkpoints, bad input ---------------------------------


@pytest.mark.parametrize("codec", [identity(), fp16(), topk(0.2), powersgd(2)],
                         ids=["identity", "fp16", "topk", "powersgd"])
def test_decode_once_copies_and_decode_everywhere_keeps_bytes_compressed(codec: Any) -> None:
    n, shapes = 4, [(16, 8), (8,)]
    grads = _grads(n, shapes, 1)
    results, sent = {}, {}
    for decode in ("once", "everywhere"):
        with record() as rec:
            results[decode] = _values(_built(codec, shapes, n, decode=decode)
                                      .reduce_gradients(grads))
        copies = [t for t in rec.transfers if t.note == "decoded" and t.nbytes == 16 * 8 * 4]
        assert len(copies) == (n - 1 if decode == "once" else 0)  # dense copies from tower 0
        sent[decode] = rec.bytes_sent()
    for j in range(len(shapes)):
        assert results["once"][0][j].tobytes() == results["everywhere"][0][j].tobytes()
    assert sent["everywhere"][DEVICES[0]] < sent["once"][DEVICES[0]]
    if isinstance(codec, Identity):  # the baseline is the plain algorithm
        for j in range(len(shapes)):
            plain = ring()([g[j] for g in grads])[0].numpy()
            assert results["everywhere"][0][j].tobytes() == plain.tobytes()


@pytest.mark.parametrize("codec", [topk(0.2), powersgd(2)], ids=["topk", "powersgd"])
def test_state_lives_on_each_tower_and_survives_a_checkpoint(codec: Any, tmp_path: Any) -> None:
    n, shapes = 3, [(16, 8), (8,)]
    reducer = _built(codec, shapes, n)
    for t, row in enumerate(reducer.state):
        assert all(canonical_device(v.device) == DEVICES[t] for var in row for v in var)
    for step in range(2):
        reducer.reduce_gradients(_grads(n, shapes, step))
    path = tf.train.Checkpoint(reducer=reducer).save(str(tmp_path / "ckpt"))
    restored = _built(codec, shapes, n)
    assert not _same(_state(restored), _state(reducer))  # fresh state before the restore
    tf.train.Checkpoint(reducer=restored).restore(path).assert_consumed()
    assert _same(_state(restored), _state(reducer))
    grads = _grads(n, shapes, 7)  # and both continue identically
    for a, b in zip(_values(reducer.reduce_gradients(grads)),
                    _values(restored.reduce_gradients(grads))):
        assert [x.tobytes() for x in a] == [x.tobytes() for x in b]


def test_state_is_created_eagerly_and_used_only_after_build() -> None:
    reducer = compressed("ring", topk(0.5))
    with pytest.raises(RuntimeError, match="build"):
        reducer.reduce_gradients(_grads(2, [(3,)], 0))

    @tf.function
    def build_in_graph() -> None:
        reducer.build([tf.Variable(tf.zeros([3]))], DEVICES[:2])

    with pytest.raises(RuntimeError, match="eagerly"):
        build_in_graph()
    reducer.build([tf.Variable(tf.zeros([3]))], DEVICES[:2])
    with pytest.raises(ValueError, match="2 towers"):
        reducer.reduce_gradients(_grads(3, [(3,)], 0))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: topk(0), "ratio"),
        (lambda: topk(1.5), "ratio"),
        (lambda: topk(-0.1), "ratio"),
        (lambda: topk(float("nan")), "ratio"),
        (lambda: topk(True), "ratio"),
        (lambda: powersgd(0), "rank"),
        (lambda: powersgd(1.5), "rank"),
        (lambda: compressed("ring", "zip"), "codec"),
        (lambda: compressed("ring", object()), "codec"),
        (lambda: compressed("ring", "fp16", decode="twice"), "decode"),
        (lambda: compressed("butterfly", "fp16"), "all_reduce"),
    ],
)
def test_bad_arguments_are_refused_by_name(build: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


# --- training on digits ----------------------------------------------------------------------

EPOCHS = 10  # 230 steps of 64; see test_codecs_train_digits_as_well_as_uncompressed


def _train(reducer: Any) -> tuple[float, dict[str, int]]:
    x, y, x_test, y_test = digits()
    trainer = towers.TowerTrainer(
        digits_cnn, lambda: keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=DEVICES[:4], all_reduce=reducer, variables="replicated",
    )
    for epoch in range(EPOCHS):
        for xb, yb in batches(x, y, 64, seed=epoch):
            trainer.train_step(xb, yb)
    accuracy = 100 * float(np.mean(np.argmax(trainer.model(x_test), 1) == y_test))
    stats = trainer.last_step_stats
    assert stats is not None
    return accuracy, {d: stats.gradient_bytes_per_tower.get(d, 0) for d in DEVICES[:4]}


@pytest.fixture(scope="module")
def uncompressed() -> tuple[float, dict[str, int]]:
    return _train("ring")


@pytest.mark.long
@pytest.mark.parametrize("codec", [fp16(), bf16(), topk(0.1), powersgd(4)],
                         ids=["fp16", "bf16", "topk0.1", "powersgd4"])
def test_codecs_train_digits_as_well_as_uncompressed(
    codec: Any, uncompressed: tuple[float, dict[str, int]]
) -> None:
    # 4 towers, Adam 3e-3, batch 64, 10 epochs (230 steps), same data order: each codec's
    # test accuracy within 1 point of uncompressed ring training. Error feedback needs
    # more steps than 2 epochs to catch up under Adam (whose per-coordinate scaling is
    # not linear in the gradient); PowerSGD needs rank 4 to be within 1 point on every
    # seed tried (rank 1 and 2 fall 1.2–1.4 points short on one of three).
    # Why 1 point: the test set has 359 images (1 point = 3.6 images). At the accuracy
    # these runs reach (measured: ring 98.3%; fp16 98.6, bf16 98.9, topk(0.1) 97.8,
    # powersgd(4) 98.3) an accuracy's binomial standard error is sqrt(p(1-p)/359) = 0.68
    # points, and the difference of two has sqrt(2)·0.68 = 0.96: 1 point is one standard
    # error of the difference, the finest gap this test set can resolve, so the claim is
    # "no codec is measurably worse". The runs are seeded and deterministic on CPU, so
    # the threshold bounds a fixed number (largest measured gap 0.56 points), not a sample.
    base_accuracy, base_bytes = uncompressed
    accuracy, sent = _train(compressed("ring", codec))
    assert abs(accuracy - base_accuracy) <= 1.0, (accuracy, base_accuracy)
    assert sent[DEVICES[1]] < base_bytes[DEVICES[1]]  # towers other than the decoder send less
