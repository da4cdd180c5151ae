"""``towers bench``: how fast is a hand-built step, next to tf.distribute's?

The package's files are the benchmark's parts::

    timing.py     interleaved rounds: every configuration once per round (drift is shared)
    allreduce.py  the nccl-tests style table: every algorithm and tf.distribute's ops,
                  4 KB … 64 MB, #wrong checked against NumPy
    training.py   one training step: towers (algorithm × placement) against a single
                  device, MirroredStrategy (collective / ReductionToOneDevice) and
                  CentralStorageStrategy, on conv-MNIST and the 5.8 M-parameter MLP
    profile.py    where the step's time goes (TensorFlow's profiler, per op type)
    phases.py     the same profile summed per phase of the step (split, forward/backward,
                  reduce, apply, guard)
    memory.py     peak memory of a step per configuration, each in a fresh process
    pipeline.py   host slicing against the per-device input pipeline
    xla.py        towers and tf.distribute with the forward/backward under XLA
    workers.py    the cross-process all-reduce (``--workers W``), towers beside MWMS
    costmodel/    α-β-γ formulas, fitting, simulation to 1024 towers, 8 and 1024 H100s
    report.py     tables, CSV, JSON, PNG plots
    sections.py   one function per section of the command
    __main__.py   ``python -m towers.bench``, the same command on its own

Example:
    >>> from towers.bench.allreduce import run_allreduce        # doctest: +SKIP
    >>> rows = run_allreduce(devices[:4], sizes=[4096, 1 << 20])
The command itself (``add_arguments`` and ``run``) is :mod:`towers.cli.bench`.
"""

from __future__ import annotations
