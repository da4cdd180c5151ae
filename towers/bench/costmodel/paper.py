"""Scale on paper: the cost model's all-reduce at 8 and 1024 GPUs, beside published NCCL figures.

Two machines, each described by the constants written next to its preset in
:mod:`towers.bench.costmodel.model`:

======================  ==========================================================
``8xH100``              one node, 8 H100 SXM on NVLink 4 (``h100-nvlink``: α 3 µs,
                        450 GB/s per direction, HBM3 adds)
``1024xH100``           128 such nodes; between nodes one 400 Gb/s NDR InfiniBand
                        NIC per GPU (``ib-400g``: α 8 µs, 50 GB/s). Flat algorithms
                        are charged the slow link for every step (a ring over 1024
                        GPUs crosses nodes, and a step is as slow as its slowest
                        pair); ``hierarchical`` pays NVLink inside a node and IB
                        among the 128 node leaders (``inner_link``).
======================  ==========================================================

The anchor: nccl-tests' ring all-reduce on 8×H100 reaches a busbw of about 370 GB/s
for large messages (:data:`~towers.bench.costmodel.model.NCCL_H100_RING_BUSBW`). For
1024 GPUs no single published figure fits this exact machine; the line-rate bound
is written instead: a ring's busbw can not exceed the per-GPU NIC bandwidth, 50 GB/s.
Nothing here is measured: it is arithmetic on stated assumptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from towers.bench import report
from towers.bench.costmodel import model
from towers.bench.costmodel.model import NCCL_H100_RING_BUSBW, PRESETS, Link

__all__ = ["IB_400G", "SYSTEMS", "paper_section", "predict_on", "scale_on_paper"]

IB_400G = Link(alpha=8e-6, beta=1 / 50e9, gamma=3 / 3.35e12, name="ib-400g")
"""400 Gb/s NDR InfiniBand = 50 GB/s per direction per GPU; α: a GPU collective step over
IB, ~8 µs; γ: H100 HBM3 adds, as ``h100-nvlink``."""

SYSTEMS: dict[str, dict[str, Any]] = {
    "8xH100": {"n": 8, "link": PRESETS["h100-nvlink"], "inner": None, "per_node": 8,
               "anchor": ("nccl-tests ring busbw", NCCL_H100_RING_BUSBW)},
    "1024xH100": {"n": 1024, "link": IB_400G, "inner": PRESETS["h100-nvlink"], "per_node": 8,
                  "anchor": ("NIC line rate (bound)", 50e9)},
}
ALGORITHMS = ("ring", "tree", "double_binary_tree", "halving_doubling", "swing", "hierarchical")


def _predict(algorithm: str, system: dict[str, Any], nbytes: float) -> float:
    if algorithm == "hierarchical":
        params: dict[str, Any] = {"inner": "ring", "outer": "ring",
                                  "group_size": system["per_node"]}
        if system["inner"] is not None:
            params["inner_link"] = system["inner"]
        return model.predict(algorithm, system["n"], nbytes, system["link"], **params)
    return model.predict(algorithm, system["n"], nbytes, system["link"])


def predict_on(system: str, algorithm: str, nbytes: float) -> float:
    """Predicted seconds of one ``algorithm`` all-reduce of ``nbytes`` per GPU on
    ``SYSTEMS[system]`` (``hierarchical``: ring inside a node, ring among nodes).

    Raises:
        ValueError: an unknown system (listing :data:`SYSTEMS`) or algorithm.
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    return _predict(algorithm, SYSTEMS[system], nbytes)


def scale_on_paper(
    algorithms: Sequence[str] = ALGORITHMS, sizes: Sequence[int] = (1 << 20, 1 << 30)
) -> list[dict[str, Any]]:
    """One row per (system, algorithm, size): predicted µs, algbw and busbw (GB/s), and the
    system's published or bound busbw beside it."""
    rows = []
    known = set(model.ALGORITHMS)
    for name, system in SYSTEMS.items():
        anchor, anchor_busbw = system["anchor"]
        for algorithm in (a for a in algorithms if a in known):
            for nbytes in sizes:
                seconds = _predict(algorithm, system, nbytes)
                rows.append({
                    "system": name, "algorithm": algorithm, "size": nbytes,
                    "time_us": seconds * 1e6,
                    "algbw": model.algbw(nbytes, seconds) / 1e9,
                    "busbw": model.busbw(nbytes, seconds, system["n"]) / 1e9,
                    "anchor": anchor, "anchor_busbw": anchor_busbw / 1e9,
                })
    return rows


def paper_section(args: Any, devices: list[str], results: dict) -> bool:
    """``towers bench --sections paper``: the table, and ``scale_on_paper.csv``."""
    print("\n== scale on paper: the alpha-beta-gamma model at 8 and 1024 H100s "
          "(arithmetic on the presets' stated constants, not a measurement)", flush=True)
    rows = scale_on_paper()
    print(report.format_table([
        ("system\n", "l", lambda r: r["system"]), ("algorithm\n", "l", lambda r: r["algorithm"]),
        ("size\n(B)", "r", lambda r: str(r["size"])),
        ("time\n(us)", "r", lambda r: f"{r['time_us']:.1f}"),
        ("busbw\n(GB/s)", "r", lambda r: f"{r['busbw']:.1f}"),
        ("published / bound\n(GB/s)", "r", lambda r: f"{r['anchor_busbw']:.0f} {r['anchor']}"),
    ], rows))
    results["paper"] = rows
    report.write_csv(args.out / "scale_on_paper.csv", rows)
    return True
