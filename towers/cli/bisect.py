"""Find where two steps part: the first step, variable and element outside the bound.

Runs ``towers.testing.bisect`` (on the bundled digits, or your model and data): A (the
teacher) and B train on the same batches; before every step B is set to A's weights, and
it stops at the first step outside the bound. Two towers trainers are compared on their
reduced gradients; anything else (a ``tf.distribute`` reference, your step) on one update,
within the bound the report names (plain SGD's derived one, or ``--bound``). The report
names the step, its first variable in model order and the first element there: its chunk
under B's split, both values, the difference and the bound.

--a and --b take what ``towers compare`` takes: ``module:factory`` (your step), a
registered name, ``towers:NAME``, ``module:function`` (a user's reduction or a factory of
one), ``mirrored`` or ``central_storage``.

Exit status: 0 when no step left the bound, 1 when one did, 3 when only kernel noise did
(see ``towers compare``), 2 for bad options.
"""

from __future__ import annotations

import argparse

from towers.cli.compare import add_arguments, run_steps

__all__ = ["EPILOG", "add_arguments", "run"]

EPILOG = """examples:
  python -m towers bisect --a ring --b towers:naive --towers 4 --steps 5
  python -m towers bisect --a ring --b mirrored --model conv
  python -m towers bisect --a naive --b my_algos.py:star --towers 3
  python -m towers bisect --a towers.step:TowerTrainer --b my_loop:make_step --data d.npz
"""


def run(args: argparse.Namespace) -> int:
    """Run the bisection; returns a process exit code."""
    return run_steps(args, "bisect")
