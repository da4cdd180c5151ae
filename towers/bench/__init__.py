"""``towers bench``: how fast is a hand-built step, next to tf.distribute's?

The package's files are the benchmark's parts::

    timing.py     interleaved rounds: every configuration once per round (drift is shared)
    allreduce.py  the nccl-tests style table: every algorithm and tf.distribute's ops,
                  4 KB … 64 MB, #wrong checked against NumPy
    costcheck.py  the α-β-γ model fitted to those rows: in-sample and on held-out sizes
    training.py   one training step: towers (algorithm × placement) against a single
                  device, MirroredStrategy (collective / ReductionToOneDevice) and
                  CentralStorageStrategy, on conv-MNIST and the 5.8 M-parameter MLP
    scaling.py    trace time and graph size against towers × buckets
    profile.py    where the step's time goes (TensorFlow's profiler, per op type)
    report.py     tables, CSV, JSON, PNG plots
    sections.py   one function per section of the command, and the targets
    costmodel.py  α-β-γ formulas per algorithm: coefficients, predict, presets, busbw
    costfit.py    fitting α, β, γ to measured rows; predicted vs measured
    simulate.py   the model carried to 1024 GPUs: times per tower count and their plot
    __main__.py   ``python -m towers.bench``, the same command on its own

Example:
    >>> from towers.bench.allreduce import run_allreduce        # doctest: +SKIP
    >>> rows = run_allreduce(devices[:4], sizes=[4096, 1 << 20])
The command itself (``add_arguments`` and ``run``) is :mod:`towers.cli.bench`.
"""

from __future__ import annotations
