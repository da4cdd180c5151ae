"""The simulation's numbers up to 1024 towers against the α-β-γ formulas, written out here.

Each expected time is the textbook closed form (Thakur et al. 2005, nccl-tests'
PERFORMANCE.md), computed in this file from the link's three constants, not through
:func:`towers.bench.costmodel.coefficients`.
"""

from __future__ import annotations

import math

import pytest

from towers.bench import costmodel as sim
from towers.bench.costmodel import DEFAULT_TOWERS, NCCL_H100_RING_BUSBW, PRESETS, Link, busbw

ODD = Link(alpha=7e-6, beta=1 / 11e9, gamma=1 / 3e9, name="odd")  # no two terms alike
LINKS = [ODD, PRESETS["h100-nvlink"], PRESETS["ib-100g"]]
SIZES = [0, 4096, 3 * 2**20 + 4, 2**30]
TOWERS = [*DEFAULT_TOWERS, 3, 6, 12, 100, 1000]  # 2 ... 1024 and some that are not 2^k


def ring(n: int, s: float, link: Link) -> float:
    a, b, g = link.alpha, link.beta, link.gamma
    return 2 * (n - 1) * a + 2 * (n - 1) / n * s * b + (n - 1) / n * s * g


def halving_doubling(n: int, s: float, link: Link) -> float:
    p = 2 ** int(math.log2(n))  # the largest power of two <= n
    t = 2 * math.log2(p) * link.alpha + 2 * (p - 1) / p * s * link.beta
    t += (p - 1) / p * s * link.gamma
    if n > p:  # the n - p extra towers fold in (send S, partner adds) and fold out
        t += 2 * (link.alpha + s * link.beta) + s * link.gamma
    return t


def naive(n: int, s: float, link: Link) -> float:
    return 2 * (n - 1) * (link.alpha + s * link.beta) + (n - 1) * s * link.gamma


def nccl_tree(n: int, s: float, link: Link) -> float:
    levels = math.ceil(math.log2(n))
    return 2 * levels * (link.alpha + s * link.beta) + levels * s * link.gamma


FORMULAS = {"ring": ring, "nccl_ring": ring, "halving_doubling": halving_doubling,
            "naive": naive, "nccl_tree": nccl_tree}


@pytest.mark.parametrize("link", LINKS, ids=lambda link: link.name)
@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("algorithm", sorted(FORMULAS))
def test_simulated_times_are_the_closed_forms(algorithm, nbytes, link):
    got = [sim.predict(algorithm, n, nbytes, link) for n in TOWERS]
    expected = [FORMULAS[algorithm](n, nbytes, link) for n in TOWERS]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-18)


def test_halving_doubling_at_powers_of_two_saves_only_latency_over_the_ring():
    for n in DEFAULT_TOWERS:
        ring_t, hd_t = (sim.predict(a, n, 2**26, ODD) for a in ("ring", "halving_doubling"))
        assert ring_t - hd_t == pytest.approx((2 * (n - 1) - 2 * math.log2(n)) * ODD.alpha)
    assert sim.predict("halving_doubling", 1024, 0, ODD) == pytest.approx(20 * ODD.alpha)


@pytest.mark.parametrize("link", LINKS, ids=lambda link: link.name)
def test_ring_busbw_is_s_over_n_alpha_plus_s_beta_plus_half_s_gamma(link):
    # busbw = algbw · 2(n-1)/n; the ring's 2(n-1)/n cancels: S / (nα + Sβ + Sγ/2).
    s = 2**28
    for n in DEFAULT_TOWERS:
        t = sim.predict("ring", n, s, link)
        expected = s / (n * link.alpha + s * link.beta + s * link.gamma / 2)
        assert busbw(s, t, n) == pytest.approx(expected, rel=1e-12)
        assert busbw(s, t, n) < link.bandwidth  # never beats the link


def test_h100_ring_busbw_at_8_gpus_is_in_the_published_range():
    """NCCL ring all-reduce on 8×H100 SXM (NVLink 4) reports ~370 GB/s busbw at 1 GiB."""
    link, n, s = PRESETS["h100-nvlink"], 8, 2**30
    # From the preset's sources: 450 GB/s NVLink per direction, 3.35 TB/s HBM3 (an add
    # reads two bytes and writes one), 3 µs a step.
    assert (1 / link.beta, 3 / link.gamma, link.alpha) == pytest.approx((450e9, 3.35e12, 3e-6))
    expected = s / (n * link.alpha + s * link.beta + s * link.gamma / 2)
    t = sim.predict("ring", n, s, link)
    assert busbw(s, t, n) == pytest.approx(expected, rel=1e-12)
    assert 360e9 < expected < 380e9  # the published figure, ~370 GB/s
    assert expected == pytest.approx(NCCL_H100_RING_BUSBW, rel=0.03)
