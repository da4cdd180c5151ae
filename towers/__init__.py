"""towers: exact, teachable data-parallel training in TensorFlow, built by hand.

The package's top level is the data flow of one step (docs/architecture.md)::

    devices.py    simulate_devices(n): the towers' devices
    split.py      a global batch -> one shard per tower (MirroredStrategy's rule)
    tower.py      one tower's forward and backward under its own GradientTape
    allreduce/    the all-reduce algorithms, one module each, and their registry
    placement.py  where variables live: one copy on a parameter device, one per tower,
                  or one per tower with the optimizer state sharded (ZeRO 1–2)
    step.py       TowerTrainer: forward_backward -> reduce -> apply

Tools are sub-packages that call the step's public phases: ``training/`` (fit,
checkpoint, export), ``trace/`` (schedules, pictures, timelines), ``bench/``
(benchmarks, cost model), ``testing/`` (Hypothesis strategies, error bound,
checker), ``guard/`` (the checks a step makes before it changes anything, and the
package's error types) and ``cli/`` (``python -m towers``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

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
from towers.split import split
from towers.step import TowerTrainer

__all__ = [
    "ALGORITHMS",
    "AlgorithmError",
    "CheckpointError",
    "NonFiniteError",
    "ReplicaMismatchError",
    "StepTimeout",
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

MOVED: dict[str, str] = {
    "towers.trainer": "towers.step",
    "towers.replicas": "towers.placement",
    "towers.fit": "towers.training.fit",
    "towers.checkpoint": "towers.training.checkpoint",
    "towers.export": "towers.training.export",
    "towers.data": "towers.training.data",
    "towers.models": "towers.training.models",
    "towers.ordering": "towers.allreduce.ordering",
    "towers.costmodel": "towers.bench.costmodel",
    "towers.trace_draw": "towers.trace.draw",
    "towers.trace_text": "towers.trace.text",
    "towers.timeline_job": "towers.cli.timeline",
    "towers.train_job": "towers.cli.train",
    "towers.trace_job": "towers.cli.trace",
    "towers.check_job": "towers.cli.check",
    "towers.bench.cli": "towers.cli.bench",
    "towers.allreduce.check": "towers.testing.check",
    "towers.allreduce.replay": "towers.testing.replay",
}
"""Modules that moved when the package was laid out by its data flow: old name -> new.
The old names keep working (``import towers.checkpoint``, ``towers.checkpoint.save``)."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import an old module name as the module that now holds its code (same object)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed under its new name."""


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> ModuleType:
    """``towers.checkpoint`` and the other moved modules, as attributes of the package."""
    if f"towers.{name}" in MOVED:
        return importlib.import_module(f"towers.{name}")
    raise AttributeError(f"module 'towers' has no attribute {name!r}")
