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
"""

from __future__ import annotations

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
