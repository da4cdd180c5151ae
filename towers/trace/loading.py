"""The devices a tool runs on, whether or not TensorFlow has started: :func:`start_devices`.

What a user types for the algorithm is resolved by
:func:`towers.allreduce.machinery.resolve.get`, as everywhere else.

Example:
    >>> devices = start_devices(4)                                # doctest: +SKIP
"""

from __future__ import annotations

from towers.devices import local_devices, simulate_devices

__all__ = ["start_devices"]


def start_devices(n: int) -> list[str]:
    """``towers.simulate_devices(n)``, or the first ``n`` devices if TensorFlow already runs.

    Raises:
        RuntimeError: TensorFlow already started with fewer than ``n`` devices.
    """
    try:
        return simulate_devices(n)
    except RuntimeError:
        have = local_devices()
        if len(have) < n:
            raise
        return have[:n]
