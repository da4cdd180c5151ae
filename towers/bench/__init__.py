"""``towers bench``: how fast is a hand-built step, next to tf.distribute's? (docs/performance.md)

One module per section, each with ``section(args, devices, results)``; the command itself is
:mod:`towers.cli.bench`; ``study.py`` is ``towers study``, ``workers.py`` ``--workers W``.
"""
