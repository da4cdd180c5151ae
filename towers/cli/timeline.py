"""``towers timeline``: one training step as a Perfetto / chrome://tracing timeline.

The work is :mod:`towers.trace.timeline`; this module is the command's entry point.
"""

from __future__ import annotations

from towers.trace import timeline as _timeline
from towers.trace.timeline import EPILOG, add_arguments, run

__doc__ = _timeline.__doc__
__all__ = ["EPILOG", "add_arguments", "run"]
