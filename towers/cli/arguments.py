"""The command line's one grammar: argparse types every command uses for names and paths.

An algorithm or a codec is a registry name or ``module:NAME`` (``file.py:NAME``) in every
command; a list is comma-separated; an output path must be writable. Each type is checked
while the arguments are parsed, so a bad value exits 2 with one line that names the
option, before any work (argparse: ``towers bench: error: argument --ops: ...``).

Parsing imports no TensorFlow, so a usage error answers at once: registry names are
checked against :mod:`towers.cli.names`, and ``module:NAME`` only as far as finding the
file or the module without running it. A :class:`Named` type then ``load`` s what the
user named, after parsing and before the command runs (the user's module may import
TensorFlow): a module that fails to import, a missing or wrong ``NAME`` is still a usage
error naming the option.

Example:
    >>> parser.add_argument("--algorithm", type=algorithm, default="ring")  # doctest: +SKIP
    >>> parser.add_argument("--ops", type=choices(ops, "op"))               # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import difflib
import importlib.machinery
import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from towers.cli import names

__all__ = [
    "Named", "algorithm", "algorithm_or_collective", "algorithms", "choices", "codec",
    "did_you_mean", "dtypes", "importable", "ops", "output_dir", "output_file", "spec_found",
    "user_object",
]


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` for the nearest of ``known`` to ``word``, or ``""``: the
    resolver's own wording (towers.allreduce.machinery.resolve), one style everywhere."""
    known = list(known)
    close = ([k for k in known if k.lower() == word.lower()]
             or difflib.get_close_matches(word, known, n=3, cutoff=0.6))
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def ops() -> tuple[str, ...]:
    """The reductions of the contract (``towers.allreduce.machinery.base.OPS``)."""
    return names.OPS


def dtypes() -> tuple[str, ...]:
    """The dtypes of the contract, by name (``towers.allreduce.machinery.base.DTYPES``)."""
    return names.DTYPES


def _items(text: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
    return items


class Named:
    """An argparse ``type`` whose value may name a user's object (``module:NAME``).

    Called while parsing, it checks without importing anything (a registered name, a file
    that exists, a module that can be found); :meth:`load` then imports what the value
    names and checks it, after parsing (``towers.cli.main`` calls it for every such option).

    Args:
        check: ``text -> value``, raising ``argparse.ArgumentTypeError``; no TensorFlow.
        load_one: ``text -> None`` for one name, raising ``argparse.ArgumentTypeError``.
        name: what argparse calls the type.
    """

    def __init__(self, check: Callable[[str], Any], load_one: Callable[[str], None],
                 name: str) -> None:
        self._check, self._load_one, self.__name__ = check, load_one, name

    def __call__(self, text: str) -> Any:
        return self._check(text)

    def load(self, value: Any) -> None:
        """Import and check every ``module:NAME`` in ``value`` (a name or a list of them)."""
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and (":" in item or "(" in item):
                self._load_one(item)


def _findable(module: str) -> bool:
    """Can ``module`` (dotted) be imported, as far as finding it without running it tells?
    The current folder is searched last, as the resolver's ``imported`` does."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # a module in sys.modules without a spec: it exists
        return True
    spec = spec or importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
    for part in rest:
        if spec is None:
            return False
        if spec.submodule_search_locations is None:  # a module's attribute (os.path): import
            return True
        spec = importlib.machinery.PathFinder.find_spec(f"{spec.name}.{part}",
                                                        list(spec.submodule_search_locations))
    return spec is not None


def spec_found(text: str, what: str) -> str:
    """``text`` as ``module:NAME`` or ``file.py:NAME`` whose file exists or whose module can
    be found (nothing is imported: the module may import TensorFlow)."""
    module, sep, attr = text.rpartition(":")
    if not sep or not module or not attr:
        raise argparse.ArgumentTypeError(
            f"{what} {text!r}: expected module:NAME or file.py:NAME")
    if module.endswith(".py"):
        if not Path(module).is_file():
            raise argparse.ArgumentTypeError(
                f"no such file {module!r} (for {what} {text}); give the path of a .py file")
    elif not _findable(module):
        raise argparse.ArgumentTypeError(
            f"cannot import {module!r} for {what} {text}: no such module on the path or in "
            "the current folder")
    return text


def _user(text: str, what: str) -> object:
    from towers.allreduce.machinery.resolve import imported

    try:
        return imported(text, what)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _algorithm_name(text: str) -> str:
    if ":" in text:
        return spec_found(text, "algorithm")
    known = (*names.ALGORITHMS, "noop")
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {text!r}{did_you_mean(text, known)}; choose from "
            f"{', '.join(names.ALGORITHMS)} or name your own as module:NAME")
    return text


def _load_algorithm(text: str) -> None:
    from towers.allreduce.machinery.resolve import check

    try:
        check(text, "algorithm")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


algorithm = Named(_algorithm_name, _load_algorithm, "algorithm")


def _schedule_name(text: str) -> str:
    return text if text in names.COLLECTIVES else _algorithm_name(text)


def _load_schedule(text: str) -> None:
    if text not in names.COLLECTIVES:
        _load_algorithm(text)


algorithm_or_collective = Named(_schedule_name, _load_schedule, "algorithm")
"""An :data:`algorithm`, or a public collective's algorithm (``chain``, ``halving``, …:
``towers trace --collective``, which checks the pair)."""
"""A registered all-reduce (``towers.ALGORITHMS``, or ``noop``) or ``module:NAME``."""


def algorithms(extra: Sequence[str] = ()) -> Named:
    """A comma list of :data:`algorithm` s, or of the ``extra`` names (``tf.*`` contenders)."""

    def parse(text: str) -> list[str]:
        return [name if name in extra else algorithm(name) for name in _items(text)]

    return Named(parse, _load_algorithm, "algorithms")


def importable(what: str) -> Callable[[str], None]:
    """A loader for :class:`Named`: ``module:NAME``'s module imports and has ``NAME``."""

    def load(text: str) -> None:
        _user(text, what)

    return load


def user_object(what: str) -> Named:
    """``module:NAME`` or ``file.py:NAME`` naming a ``what`` (a step factory, a model
    factory), checked by :func:`importable` after parsing."""
    return Named(lambda text: spec_found(text, what), importable(what), what)


def _codec_name(text: str) -> str:
    if ":" in text:
        return spec_found(text, "codec")
    base = text.split("(", 1)[0].strip()
    if base not in names.CODECS:
        raise argparse.ArgumentTypeError(
            f"unknown codec {text!r}{did_you_mean(base, names.CODECS)}; registered: "
            f"{', '.join(names.CODECS)} (or name your own as module:NAME)")
    return text


def _load_codec(text: str) -> None:
    from towers.allreduce.machinery.resolve import get_codec

    try:
        get_codec(text, argument="codec")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


codec = Named(_codec_name, _load_codec, "codec")
"""A registered codec (``towers.allreduce.CODECS``; ``topk(0.1)`` passes arguments) or
``module:NAME``: the name checked while parsing, the codec built once after
(:func:`towers.allreduce.machinery.resolve.get_codec`)."""


def choices(allowed: Sequence[str] | Callable[[], Sequence[str]],
            what: str) -> Callable[[str], list[str]]:
    """A comma list of ``allowed`` values (each one a ``what``); ``allowed`` may be a
    function, called when a value is checked (a registry that imports TensorFlow)."""

    def parse(text: str) -> list[str]:
        items, known = _items(text), allowed() if callable(allowed) else allowed
        unknown = [item for item in items if item not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, unknown))}"
                f"{did_you_mean(unknown[0], known)}; choose from {', '.join(known)}")
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
