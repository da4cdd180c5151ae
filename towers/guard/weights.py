"""Checks of what a trainer is given: tower devices, and weights for ``set_weights``.

Both check everything before anything is used, and name the argument, the index and
the variable in their errors. :mod:`towers.placement` re-exports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.devices import canonical_device, local_devices

__all__ = ["check_devices", "check_weights"]


def check_devices(devices: Sequence[str] | None) -> list[str]:
    """Validate tower devices and return their canonical names.

    Raises:
        ValueError: no devices, duplicates, or a name TensorFlow does not know.
        TypeError: not a list of strings.
    """
    if devices is None:
        devices = local_devices()
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list of device names, got {devices!r}")
    if not devices:
        raise ValueError("devices is empty: give at least one device (see towers.simulate_devices)")
    known = {canonical_device(d.name) for d in tf.config.list_logical_devices()}
    out: list[str] = []
    for d in devices:
        if not isinstance(d, str):
            raise TypeError(f"devices must hold strings, got {d!r}")
        c = canonical_device(d)
        if c not in known:
            raise ValueError(f"devices: unknown device {d!r}; known: {', '.join(sorted(known))}")
        if c in out:
            raise ValueError(f"devices: {d!r} appears twice; each tower needs its own device")
        out.append(c)
    return out


def check_weights(variables: Sequence[Any], weights: Any) -> list[np.ndarray]:
    """``weights`` as arrays of ``variables``' dtypes, every one checked before any is used.

    Raises:
        TypeError: ``weights`` is not a list, or an array is not numeric, or a float
            array is given for an integer variable.
        ValueError: the count differs, or an array's shape (naming its index and variable).
    """
    if isinstance(weights, (str, bytes, np.ndarray)) or not isinstance(weights, Sequence):
        raise TypeError(
            f"weights must be a list of arrays (model.weights order), got {weights!r:.80}"
        )
    if len(weights) != len(variables):
        raise ValueError(
            f"weights: expected {len(variables)} arrays (model.weights), got {len(weights)}"
        )
    arrays = []
    for i, (v, w) in enumerate(zip(variables, weights)):
        where = f"weights[{i}] (variable {v.path}, {v.dtype}{list(v.shape)})"
        a = np.asarray(w)
        if a.dtype.kind not in "biuf":
            raise TypeError(f"{where}: expected numbers, got an array of {a.dtype}")
        if a.dtype.kind == "f" and np.dtype(v.dtype).kind in "iub":
            raise TypeError(f"{where}: a float array for an integer variable would be truncated")
        if tuple(a.shape) != tuple(v.shape):
            raise ValueError(f"{where}: got shape {list(a.shape)}")
        arrays.append(a.astype(v.dtype, copy=False))
    return arrays
