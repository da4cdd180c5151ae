"""tools/kernel_noise.py: one towers step's kernel-noise floor, measured in subprocesses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from kernel_noise import kernel_noise_floor


@pytest.mark.long  # 6 s
def test_the_floor_of_a_dense_model_over_tower_counts() -> None:
    # One subprocess (oneDNN off), the same batch over 1 and 2 towers: the towers' kernels
    # add a shard's examples in another grouping, so the gradient moves by a few ULPs of
    # its largest element (measured 4–6), never by a reduction-sized amount.
    report = kernel_noise_floor("dense", towers=(1, 2), onednn=("0",), graphs=("default",))
    assert list(report.ulps) == ["onednn=0,towers=2,graph=default"]
    assert 0 < report.floor_ulps < 1000
    assert report.worst is not None and report.worst[0] == "onednn=0,towers=2,graph=default"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"family": "mlp"}, "family must be one of"),
        ({"family": "dense", "towers": (0,)}, "towers must be an int >= 1"),
        ({"family": "dense", "towers": (32,)}, r"towers must be non-empty counts <= batch"),
        ({"family": "dense", "onednn": ("on",)}, "onednn must be one of"),
        ({"family": "dense", "graphs": ("xla",)}, "graphs must be one of"),
        ({"family": "dense", "timeout": 0}, "timeout must be"),
    ],
    ids=["family", "towers", "too-many-towers", "onednn", "graphs", "timeout"],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kernel_noise_floor(**kwargs)
