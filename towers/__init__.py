"""towers: exact, teachable data-parallel training in TensorFlow, built by hand.

The package's top level is the data flow of one step (docs/architecture.md)::

    devices.py    simulate_devices(n): the towers' devices
    split.py      a global batch -> one shard per tower (MirroredStrategy's rule)
    tower.py      one tower's forward and backward under its own GradientTape
    allreduce/    the all-reduce algorithms, one module each, and their registry
    placement.py  where variables live: one copy on a parameter device, one per tower,
                  or one per tower with the optimizer state sharded (ZeRO 1–2)
    step.py       TowerTrainer: forward_backward -> reduce -> apply
    model.py      TowerModel: the Keras face of step.py (compile, fit, evaluate, predict,
                  save run the towers step) — the last stage of the data flow

Tools are sub-packages that call the step's public phases (``training/``, ``trace/``,
``bench/``, ``testing/``, ``guard/``, ``cli/``). The top-level names are loaded on first use
(PEP 562), so ``import towers`` does not import TensorFlow and ``towers --help`` answers at
once; ``_LAZY`` maps each name to the module that owns it.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what mypy and editors see; at run time __getattr__ loads these
    from towers.allreduce import ALGORITHMS, all_reduce, bucketed, compressed
    from towers.devices import local_devices, simulate_devices
    from towers.guard.errors import (
        AlgorithmError,
        CheckpointError,
        NonFiniteError,
        ReplicaMismatchError,
        StepTimeout,
        TowersError,
    )
    from towers.model import TowerModel
    from towers.split import split
    from towers.step import TowerTrainer

_LAZY: dict[str, str] = {
    "ALGORITHMS": "towers.allreduce",
    "all_reduce": "towers.allreduce",
    "bucketed": "towers.allreduce",
    "compressed": "towers.allreduce",
    "local_devices": "towers.devices",
    "simulate_devices": "towers.devices",
    "AlgorithmError": "towers.guard.errors",
    "CheckpointError": "towers.guard.errors",
    "NonFiniteError": "towers.guard.errors",
    "ReplicaMismatchError": "towers.guard.errors",
    "StepTimeout": "towers.guard.errors",
    "TowersError": "towers.guard.errors",
    "split": "towers.split",
    "TowerTrainer": "towers.step",
    "TowerModel": "towers.model",
}

__all__ = [
    "ALGORITHMS",
    "AlgorithmError",
    "CheckpointError",
    "NonFiniteError",
    "ReplicaMismatchError",
    "StepTimeout",
    "TowerModel",
    "TowerTrainer",
    "TowersError",
    "all_reduce",
    "bucketed",
    "compressed",
    "local_devices",
    "simulate_devices",
    "split",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import the module that owns ``name`` on first access and cache the value here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'towers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: importing ``towers.split`` (the module) does not hide the
    public function ``towers.split``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
