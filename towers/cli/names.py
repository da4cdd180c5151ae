"""The names the command line checks while it parses, without importing TensorFlow.

The registries import TensorFlow, which takes seconds, and a usage error must not wait for
it (nor can a module under ``towers/allreduce`` hold them: its package imports TensorFlow).
These tuples are their names; ``tests/cli/test_fast.py`` keeps them equal, so a new
algorithm or codec is one line here beside its registration.
"""

from __future__ import annotations

__all__ = ["ALGORITHMS", "CODECS", "COLLECTIVES", "DTYPES", "OPS", "REFERENCES"]

ALGORITHMS = (
    "bruck", "double_binary_tree", "halving_doubling", "hierarchical", "naive", "nccl",
    "nccl_ring", "nccl_tree", "parameter_device", "pat", "ring", "swing", "torus_2d", "tree",
)
"""The registered all-reduces, sorted (``sorted(towers.ALGORITHMS)``)."""

COLLECTIVES = ("chain", "doubling", "flat", "halving", "ring", "tree")
"""The public collectives' algorithms (``towers.allreduce.COLLECTIVE_ALGORITHMS``' second
names), which ``towers trace --collective`` takes as ``--algorithm``."""

CODECS = ("bf16", "fp16", "identity", "powersgd", "topk")
"""The registered codecs, sorted (``sorted(towers.allreduce.CODECS)``)."""

OPS = ("sum", "mean", "max", "min")
"""The reductions of the contract."""

DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
"""The dtypes of the contract, by name."""

REFERENCES = ("mirrored", "central_storage")
"""The ``tf.distribute`` references ``towers compare`` and ``towers bisect`` may name."""
