"""towers: exact, teachable data-parallel training in TensorFlow, built by hand.

A batch is split over explicit ``tf.device`` towers; each tower runs the model
under its own ``tf.GradientTape``; gradients are combined by the library's own
all-reduce algorithms; the update is applied on a parameter device or on every
replica. See README.md for the picture.
"""

from __future__ import annotations

from towers.allreduce import ALGORITHMS, all_reduce, bucketed, compressed
from towers.devices import local_devices, simulate_devices
from towers.split import split
from towers.trainer import TowerTrainer

__all__ = [
    "ALGORITHMS",
    "TowerTrainer",
    "all_reduce",
    "bucketed",
    "compressed",
    "local_devices",
    "simulate_devices",
    "split",
]

__version__ = "0.1.0"
