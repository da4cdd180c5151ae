"""Simulated devices: split one physical device into ``n`` logical ones.

TensorFlow fixes its device list when its runtime starts (the first op, or the
first call that lists logical devices). :func:`simulate_devices` must therefore
run first thing in a process, before any tensor is made.

By default, on a machine with a GPU, GPU 0 is split into ``n`` logical GPUs, each
with a memory limit; otherwise the host CPU is split into ``n`` logical CPUs.
``kind="cpu"`` always splits the CPU and leaves every GPU as it is, so code that
needs real GPUs (one NCCL rank per physical GPU) still finds them. Logical CPUs
share one memory and one thread pool: they are correct for testing numerics and
schedules, not for measuring bandwidth.

Example:
    >>> import towers
    >>> devices = towers.simulate_devices(4)   # doctest: +SKIP
    >>> devices                                # doctest: +SKIP
    ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.guard.arguments import non_negative_int, positive_int

__all__ = ["canonical_device", "has_gpu", "local_devices", "one_memory", "simulate_devices"]

_DEFAULT_GPU_MEMORY_MB = 1024
MAX_SIMULATED = 4096
"""The most logical devices :func:`simulate_devices` makes (the fuzz once asked for 2**31)."""


def has_gpu() -> bool:
    """True when TensorFlow sees at least one physical GPU (does not start the runtime)."""
    return bool(tf.config.list_physical_devices("GPU"))


def _kind() -> str:
    return "GPU" if has_gpu() else "CPU"


def _check_kind(kind: str | None) -> str:
    """``None`` -> GPU if any, else CPU; ``"cpu"``/``"gpu"`` (any case) -> upper case."""
    if kind is None:
        return _kind()
    if not isinstance(kind, str) or kind.upper() not in ("CPU", "GPU"):
        raise ValueError(f"kind must be 'cpu', 'gpu' or None (GPU if any, else CPU), got {kind!r}")
    if kind.upper() == "GPU" and not has_gpu():
        raise ValueError("kind='gpu' needs a physical GPU, and TensorFlow sees none")
    return kind.upper()


def local_devices(kind: str | None = None) -> list[str]:
    """Names of the logical devices of ``kind`` ("CPU" or "GPU"; default: GPU if any, else CPU).

    This starts TensorFlow's runtime: call :func:`simulate_devices` before it.
    """
    kind = kind or _kind()
    if kind not in ("CPU", "GPU"):
        raise ValueError(f"kind must be 'CPU' or 'GPU', got {kind!r}")
    return [d.name for d in tf.config.list_logical_devices(kind)]


def _configured_count(physical: tf.config.PhysicalDevice) -> int | None:
    configs = tf.config.get_logical_device_configuration(physical)
    return None if configs is None else len(configs)


def simulate_devices(
    n: int, *, kind: str | None = None, gpu_memory_mb: int = _DEFAULT_GPU_MEMORY_MB
) -> list[str]:
    """Split the first physical device into ``n`` logical devices and return their names.

    Args:
        n: number of logical devices (towers) to create, at least 1.
        kind: ``"cpu"`` (split the host CPU; GPUs, if any, stay whole and usable),
            ``"gpu"`` (split GPU 0), or ``None`` (default: GPU 0 if there is a GPU,
            else the CPU).
        gpu_memory_mb: memory limit of each logical GPU (ignored on CPU).

    Returns:
        The ``n`` device names, e.g. ``['/device:CPU:0', ...]``.

    Raises:
        TypeError: ``n`` is not an int.
        ValueError: ``n`` < 1 or > ``MAX_SIMULATED``, ``gpu_memory_mb`` < 1, or a bad
            ``kind`` (or ``"gpu"`` without a GPU).
        RuntimeError: TensorFlow's runtime already started with another device count.
            Calling again with the same ``n`` is a no-op.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int (number of devices), got {type(n).__name__}")
    positive_int("n", n)
    if n > MAX_SIMULATED:  # a list of 2**31 device configurations would exhaust memory
        raise ValueError(f"n must be at most {MAX_SIMULATED} (simulated devices), got {n}")
    if isinstance(gpu_memory_mb, bool) or not isinstance(gpu_memory_mb, int):
        raise TypeError(f"gpu_memory_mb must be an int (MiB), got {gpu_memory_mb!r}")
    positive_int("gpu_memory_mb", gpu_memory_mb)
    kind = _check_kind(kind)
    physical = tf.config.list_physical_devices(kind)[0]
    if _configured_count(physical) == n:
        return local_devices(kind)[:n]
    config = (
        tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_mb)
        if kind == "GPU"
        else tf.config.LogicalDeviceConfiguration()
    )
    try:
        tf.config.set_logical_device_configuration(physical, [config] * n)
    except RuntimeError as err:
        have = len(tf.config.list_logical_devices(kind))
        if have == n:
            return local_devices(kind)
        raise RuntimeError(
            f"simulate_devices({n}) came too late: TensorFlow's runtime already started with "
            f"{have} logical {kind} device(s), and it cannot be changed afterwards. Call "
            f"towers.simulate_devices({n}) first thing in your program, before any TensorFlow "
            f"op runs (or use towers.local_devices()[:{n}] if {have} >= {n})."
        ) from err
    return local_devices(kind)


_LOCAL_TASK = ["localhost", 0]
"""The (job, task) this process runs as: its devices are named without the task prefix."""


def set_local_task(job: str, task: int) -> None:
    """Declare the (job, task) this process runs as in a cluster (``towers.cluster`` does).

    Its devices then keep their short names (``/device:CPU:0``) while every other task's
    devices keep their full ``/job:J/replica:R/task:T`` prefix, so a tower on
    ``task:1/device:CPU:0`` is never mistaken for the local ``/device:CPU:0``.
    """
    if not isinstance(job, str) or not job:
        raise ValueError(f"job must be a non-empty string, got {job!r}")
    non_negative_int("task", task)
    _LOCAL_TASK[:] = [job, task]


def one_memory(devices: Sequence[str]) -> bool:
    """Every device is a CPU of one task: the towers share one memory (logical CPUs of one
    process, :func:`simulate_devices`), where a copy between them passes a pointer.

    Example:
        >>> one_memory(["/device:CPU:0", "/device:CPU:1"]), one_memory(["/device:GPU:0"])
        (True, False)
    """
    names = [canonical_device(d) for d in devices]
    tasks = {name.rsplit("/device:", 1)[0] for name in names}
    return bool(names) and len(tasks) == 1 and all("/device:CPU:" in n for n in names)


def canonical_device(name: str) -> str:
    """``'/job:localhost/replica:0/task:0/device:CPU:1'`` -> ``'/device:CPU:1'``.

    Two names denote the same device exactly when their canonical forms are equal.
    A device of this process's own task (``localhost``, or what :func:`set_local_task`
    declared) gets the short form; another task's device keeps its job, replica and task.
    An empty name stays empty.
    """
    if not name:
        return ""
    spec = tf.DeviceSpec.from_string(name)
    if spec.device_type is None:
        return name
    index = 0 if spec.device_index is None else spec.device_index
    short = f"/device:{spec.device_type.upper()}:{index}"
    task = 0 if spec.task is None else spec.task
    if spec.job is None or [spec.job, task] == _LOCAL_TASK:
        return short
    return f"/job:{spec.job}/replica:{spec.replica or 0}/task:{task}{short}"
