"""What a user types for their own algorithm or codec, ``module:NAME``, turned into the object.

The one place for every tool and every registry kind: ``towers trace|check|bench
--algorithm mymod:star`` (through :func:`towers.trace.loading.load_algorithm`) and
``compressed("ring", "mymod:my_codec")`` (through
:func:`towers.allreduce.compressed.get_codec`) both import with :func:`import_spec`.

Example:
    >>> star = import_spec("my_algos.py:star")         # doctest: +SKIP
    >>> codec = import_spec("mymod:my_codec", "codec")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["import_spec", "is_spec"]


def is_spec(text: str) -> bool:
    """Does ``text`` name a user's object (``module:NAME``) rather than a registry name?"""
    return ":" in text


def import_spec(spec: str, what: str = "algorithm") -> Any:
    """The object named by ``module:NAME`` (or ``file.py:NAME``; ``NAME`` may be dotted).

    The current directory is searched last, so ``my_module:fn`` finds ``./my_module.py``.

    Args:
        spec: ``module:NAME`` or ``path/to/file.py:NAME``.
        what: what the object is for, named in the errors (``"algorithm"``, ``"codec"``).

    Returns:
        The attribute, unchecked (a record, a factory, an instance).

    Raises:
        ValueError: no ``:``, a module that does not import (whatever it raised), or a
            missing attribute.
    """
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} {spec!r}: expected module:NAME or file.py:NAME")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        loaded = _load_module(module)
    except Exception as err:  # ImportError, and whatever the module raises (SyntaxError, ...)
        raise ValueError(f"cannot import {module!r} for {what} {spec} "
                         f"({type(err).__name__}: {err})") from err
    obj: Any = loaded
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(k for k, v in vars(loaded).items() if callable(v) and k[0] != "_")
            raise ValueError(f"module {module!r} has no {attr!r}; its callables: "
                             f"{', '.join(found) or 'none'} (for {what} {spec})")
        obj = getattr(obj, part)
    return obj


def _load_module(module: str) -> Any:
    if not module.endswith(".py"):
        return importlib.import_module(module)
    spec = importlib.util.spec_from_file_location(Path(module).stem, module)
    if spec is None or spec.loader is None or not Path(module).is_file():
        raise ImportError(f"no such file: {module}")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # as an import would (dataclasses look it up)
    try:
        spec.loader.exec_module(loaded)
    except BaseException:
        sys.modules.pop(spec.name, None)  # as a failed import does: no half-made module left
        raise
    return loaded
