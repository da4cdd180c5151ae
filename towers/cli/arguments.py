"""The command line's one grammar: argparse types every command uses for names and paths.

An algorithm or a codec is a registry name or ``module:NAME`` (``file.py:NAME``) in every
command; a list is comma-separated; an output path must be writable. Each type is checked
while the arguments are parsed, so a bad value exits 2 with one line that names the
option, before any work (argparse: ``towers bench: error: argument --ops: ...``).
Registry names need the registries, which import TensorFlow: the types import them only
when a value is checked, never for ``--help``.

Example:
    >>> parser.add_argument("--algorithm", type=algorithm, default="ring")  # doctest: +SKIP
    >>> parser.add_argument("--ops", type=choices(ops, "op"))               # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "algorithm", "algorithms", "choices", "codec", "dtypes", "ops", "output_dir", "output_file",
]


def ops() -> tuple[str, ...]:
    """The reductions of the contract (``towers.allreduce.machinery.base.OPS``)."""
    from towers.allreduce.machinery.base import OPS

    return tuple(OPS)


def dtypes() -> tuple[str, ...]:
    """The dtypes of the contract, by name (``towers.allreduce.machinery.base.DTYPES``)."""
    from towers.allreduce.machinery.base import DTYPES

    return tuple(d.name for d in DTYPES)


def _items(text: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
    return items


def algorithm(text: str) -> str:
    """A registered all-reduce (``towers.ALGORITHMS``, or ``noop``) or ``module:NAME``,
    checked by :func:`towers.allreduce.machinery.resolve.check` (nothing built or run)."""
    from towers.allreduce.machinery.resolve import check

    try:
        check(text, "algorithm")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def algorithms(extra: Sequence[str] = ()) -> Callable[[str], list[str]]:
    """A comma list of :func:`algorithm` s, or of the ``extra`` names (``tf.*`` contenders)."""

    def parse(text: str) -> list[str]:
        return [name if name in extra else algorithm(name) for name in _items(text)]

    parse.__name__ = "algorithms"
    return parse


def codec(text: str) -> str:
    """A registered codec (``towers.allreduce.CODECS``; ``topk(0.1)`` passes arguments) or
    ``module:NAME``, built once by :func:`towers.allreduce.machinery.resolve.get_codec`."""
    from towers.allreduce.machinery.resolve import get_codec

    try:
        get_codec(text, argument="codec")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def choices(allowed: Sequence[str] | Callable[[], Sequence[str]],
            what: str) -> Callable[[str], list[str]]:
    """A comma list of ``allowed`` values (each one a ``what``); ``allowed`` may be a
    function, called when a value is checked (a registry that imports TensorFlow)."""

    def parse(text: str) -> list[str]:
        items, known = _items(text), allowed() if callable(allowed) else allowed
        unknown = [item for item in items if item not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
        return items

    parse.__name__ = f"{what} list"
    return parse


def _probe(folder: Path, text: str) -> None:
    """Create and remove a file in ``folder``: the one test of writability that holds for
    root too (``os.access`` says yes to /proc)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"cannot write {text!r}: {folder} is not writable ({err.strerror})") from None


def output_file(text: str) -> str:
    """A file path that can be written: not a folder, in a folder that exists and is writable."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no folder {str(folder)!r}")
    _probe(folder, text)
    return text


def output_dir(text: str) -> Path:
    """A folder that is writable, or can be created (its nearest existing parent is)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    existing = path
    while not existing.is_dir():
        if existing.exists() or existing == existing.parent:
            raise argparse.ArgumentTypeError(f"cannot create folder {text!r}: {existing} "
                                             "is not a folder")
        existing = existing.parent
    _probe(existing, text)
    return path
