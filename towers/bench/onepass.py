"""The memory limit of an all-reduce on one host: NumPy sums the inputs in one pass.

On logical CPU devices a "send" passes a pointer, so an all-reduce costs what its
additions cost. The fastest any of them can be is one pass over the data: read
the ``n`` inputs once, write the sum once. :class:`OnePass` does exactly that with
NumPy, in place (``out = x0 + x1; out += x2; …``, single-threaded), and the
all-reduce table times it beside the algorithms as the ``one-pass (NumPy)`` row;
``towers bench``'s target compares the best algorithm's algbw with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["ONE_PASS", "OnePass"]

ONE_PASS = "one-pass (NumPy)"
"""The memory limit row: NumPy sums the ``n`` host inputs into one buffer in place
(``out = x0 + x1; out += x2; …``), one pass over the data, single-threaded."""


class OnePass:
    """The NumPy in-place sum of one size's host inputs (callable; ``host`` kept for checks)."""

    def __init__(self, host: Sequence[np.ndarray]) -> None:
        self.host, self.out = list(host), np.empty_like(host[0])

    def __call__(self) -> np.ndarray:
        host, out = self.host, self.out
        np.add(host[0], host[1] if len(host) > 1 else 0, out=out)
        for x in host[2:]:
            np.add(out, x, out=out)
        return out
