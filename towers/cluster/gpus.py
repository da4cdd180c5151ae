"""``configure_gpus``: which GPUs a worker uses and how their memory is taken, set first.

A worker process that shares a machine with others usually sees one GPU of its own
(``visible=[k]``), and either grows its memory as needed (``memory_growth=True``) or
takes a fixed share (``memory_limit_mb``). TensorFlow fixes all three when its runtime
starts (the first op, or the first call that lists logical devices), so this must run
first thing in the program::

    configure_gpus(visible, memory_growth, memory_limit_mb)   ← before any op
        │ 1. check the arguments             (TensorFlow untouched: errors name them)
        │ 2. list the physical GPUs          (does not start the runtime)
        │ 3. runtime started already?  ──▶  RuntimeStartedError ("call it first thing")
        │ 4. tf.config.set_visible_devices(GPUs chosen, "GPU")
        │ 5. per chosen GPU: experimental.set_memory_growth(gpu, growth)
        │                    set_logical_device_configuration(gpu, [limit])
        ▼
    the chosen GPUs' names

``memory_growth`` and ``memory_limit_mb`` exclude each other: TensorFlow refuses memory
growth on a GPU given a logical-device configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context

from towers.guard.arguments import positive_int
from towers.guard.errors import TowersError

__all__ = ["RuntimeStartedError", "configure_gpus", "runtime_started"]


class RuntimeStartedError(TowersError, RuntimeError):
    """A device setting came after TensorFlow's runtime had fixed the devices."""


def runtime_started() -> bool:
    """True once TensorFlow's eager runtime exists (its device list is then fixed)."""
    return context.context()._context_handle is not None  # private: no public query


def _check(visible: Any, memory_growth: Any, memory_limit_mb: Any) -> list[int] | None:
    """The arguments checked before TensorFlow is touched; ``visible`` as a list."""
    if visible is not None:
        if isinstance(visible, (str, bytes)) or not isinstance(visible, Sequence):
            raise TypeError(f"visible must be None or a list of GPU indices (ints), got "
                            f"{visible!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in visible):
            raise ValueError(f"visible must hold GPU indices (ints >= 0), got {list(visible)!r}")
        if len(set(visible)) != len(visible):
            raise ValueError(f"visible names a GPU twice: {list(visible)!r}")
    if memory_growth is not None and not isinstance(memory_growth, bool):
        raise TypeError(f"memory_growth must be None, True or False, got {memory_growth!r}")
    if memory_limit_mb is not None:
        if isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int):
            raise TypeError(f"memory_limit_mb must be None or an int (MiB), got "
                            f"{memory_limit_mb!r}")
        positive_int("memory_limit_mb", memory_limit_mb)
        if memory_growth:
            raise ValueError("memory_growth=True and memory_limit_mb exclude each other "
                             "(TensorFlow refuses memory growth on a GPU with a memory limit)")
    return None if visible is None else list(visible)


def _apply(chosen: list[Any], visible: bool, growth: bool | None, limit: int | None) -> None:
    if visible:
        tf.config.set_visible_devices(chosen, "GPU")
    for gpu in chosen:
        if growth is not None:
            tf.config.experimental.set_memory_growth(gpu, growth)
        if limit is not None:
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit)])


def configure_gpus(visible: Sequence[int] | None = None, memory_growth: bool | None = None,
                   memory_limit_mb: int | None = None) -> list[str]:
    """Choose this process's GPUs and how they take memory; call it first thing.

    Args:
        visible: indices of the physical GPUs to use (``[]``: none, CPU only); None
            keeps them all.
        memory_growth: True to allocate GPU memory as needed, False to take it at
            once; None leaves TensorFlow's default.
        memory_limit_mb: a fixed memory limit (MiB) per chosen GPU; None: no limit.

    Returns:
        The physical names of the chosen GPUs, e.g. ``['/physical_device:GPU:1']``.

    Raises:
        TypeError, ValueError: a bad argument (named); ``visible`` asking for a GPU that
            does not exist (the message lists those that do).
        RuntimeStartedError: a setting asked for after TensorFlow's runtime started.

    Example:
        >>> configure_gpus(visible=[], memory_growth=None)  # doctest: +SKIP
        []
    """
    indices = _check(visible, memory_growth, memory_limit_mb)
    gpus = tf.config.list_physical_devices("GPU")
    if indices is not None and any(i >= len(gpus) for i in indices):
        raise ValueError(f"visible={indices} asks for a GPU that does not exist: this machine "
                         f"has {len(gpus)} GPU(s) {[g.name for g in gpus]} (indices "
                         f"0..{len(gpus) - 1})" if gpus else
                         f"visible={indices} asks for a GPU, and this machine has none "
                         f"(use visible=[] or None)")
    chosen = gpus if indices is None else [gpus[i] for i in indices]
    asked = indices is not None or memory_growth is not None or memory_limit_mb is not None
    if asked and runtime_started():
        raise RuntimeStartedError(
            "configure_gpus must be called before TensorFlow initializes its devices; call "
            "it first thing in the program, before any TensorFlow op or device listing "
            "(and before towers.simulate_devices or start_worker)")
    try:
        _apply(chosen, indices is not None, memory_growth, memory_limit_mb)
    except RuntimeError as err:  # the runtime started between the check and the call
        raise RuntimeStartedError(
            f"configure_gpus must be called before TensorFlow initializes its devices; call "
            f"it first thing ({err})") from err
    return [g.name for g in chosen]
