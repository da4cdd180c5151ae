"""``towers bench``: how fast is a hand-built step, next to tf.distribute's?

One module per section of the command, each with its ``section(args, devices, results)``::

    allreduce.py  the nccl-tests style table: every algorithm and tf.distribute's ops,
                  4 KB … 64 MB, #wrong checked against NumPy
    costmodel.py  α-β-γ formulas from the registry, 8 and 1024 H100s on paper
    costfit.py    the formulas fitted to the all-reduce table (the costmodel section)
    training.py   one training step: towers (algorithm × placement) against a single
                  device, MirroredStrategy and CentralStorageStrategy
    phases.py     the step's time per phase (split, forward/backward, reduce, apply, guard)
    memory.py     peak memory of a step per configuration, each in a fresh process
    workers.py    the cross-process all-reduce (``--workers W``), towers beside MWMS
    study.py      ``towers study``: reducers and codecs, loss against bytes and predicted time
    timing.py     interleaved rounds: every configuration once per round (drift is shared)
    report.py     tables, CSV, JSON, PNG

The command itself (``add_arguments`` and ``run``) is :mod:`towers.cli.bench`.
"""
