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

Tools are sub-packages that call the step's public phases: ``training/`` (fit,
checkpoint, export), ``trace/`` (schedules, pictures, timelines), ``bench/``
(benchmarks, cost model), ``testing/`` (Hypothesis strategies, error bound,
checker), ``guard/`` (the checks a step makes before it changes anything, and the
package's error types) and ``cli/`` (``python -m towers``).

The top-level names are loaded on first use (PEP 562): ``import towers`` does not
import TensorFlow, so ``towers --help`` answers at once and ``towers.cli`` parses its
arguments before TensorFlow starts. ``_LAZY`` maps each name to the module that owns it;
a new public name is one line there, one in the ``TYPE_CHECKING`` block and one in
``__all__``.
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
"""Public name -> the module that defines it (imported on first access)."""

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
    """Import the module that owns ``name`` on first access and cache the value here.

    Raises:
        AttributeError: ``name`` is not a public name of the package.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'towers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: a submodule never hides the public name it shares.

    Importing ``towers.split`` (the module) would set ``towers.split`` to it; the public
    ``towers.split`` is the function, as it was when this file imported it eagerly.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
