"""The command line's argparse types. Parsing imports no TensorFlow: names are checked
against the tuples below (tests keep them equal to the registries), ``module:NAME`` only as
far as finding the module; a :class:`Named` type ``load`` s it after parsing."""

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

__all__ = ["ALGORITHMS", "CODECS", "COLLECTIVES", "DTYPES", "MODELS", "OPS", "PLACEMENTS",
           "REFERENCES", "VARIABLES", "Named", "algorithm", "algorithm_or_collective",
           "algorithms", "at_least", "choices", "codec", "compared_step", "did_you_mean",
           "model", "output_dir", "output_file", "output_prefix", "positive_float", "reducer",
           "step", "tower_counts"]

ALGORITHMS = (  # sorted(towers.ALGORITHMS)
    "bruck", "double_binary_tree", "halving_doubling", "hierarchical", "naive", "nccl",
    "nccl_ring", "nccl_tree", "parameter_device", "pat", "ring", "swing", "torus_2d", "tree",
)
COLLECTIVES = ("chain", "doubling", "flat", "halving", "ring", "tree")  # trace --collective
CODECS = ("bf16", "fp16", "identity", "powersgd", "topk")  # sorted(towers.allreduce.CODECS)
OPS = ("sum", "mean", "max", "min")  # the contract's reductions
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")  # and dtypes
REFERENCES = ("mirrored", "central_storage")  # tf.distribute, for compare and bisect
VARIABLES = ("replicated", "parameter_device")  # the placements a command line may name
PLACEMENTS = ("parameter_device", "replicated", "sharded")  # towers.step.PLACEMENTS (bench)
MODELS = ("conv-mnist", "mlp")  # towers.bench.training.MODELS


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` for the nearest of ``known`` to ``word``, or ``""``."""
    known = list(known)
    close = ([k for k in known if k.lower() == word.lower()]
             or difflib.get_close_matches(word, known, n=3, cutoff=0.6))
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def at_least(low: int) -> Callable[[str], int]:
    """An int >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def positive_float(text: str) -> float:
    """A finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def tower_counts(text: str) -> list[int]:
    """Distinct tower counts like ``1,2,4,8``, each in 1..64, in the order given."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or len(set(counts)) != len(counts) or not all(1 <= n <= 64 for n in counts):
        raise argparse.ArgumentTypeError(
            f"expected tower counts like 1,2,4,8 (distinct tower counts in 1..64), got {text!r}")
    return counts


def _items(text: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
    return items


def choices(allowed: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """A comma list of ``allowed`` values."""

    def parse(text: str) -> list[str]:
        items = _items(text)
        unknown = [item for item in items if item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, unknown))}"
                f"{did_you_mean(unknown[0], allowed)}; choose from {', '.join(allowed)}")
        return items

    parse.__name__ = f"{what} list"
    return parse


class Named:
    """An argparse ``type`` that may name a user's object (``module:NAME``): ``check`` looks
    without importing; :meth:`load` imports after parsing. Both raise ``ArgumentTypeError``."""

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
    """Can ``module`` (dotted) be found without running it? (the current folder last)"""
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
    """``text`` as ``module:NAME`` or ``file.py:NAME`` whose module can be found (unimported)."""
    module, sep, attr = text.rpartition(":")
    if not sep or not module or not attr:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: expected module:NAME or file.py:NAME")
    if module.endswith(".py"):
        if not Path(module).is_file():
            raise argparse.ArgumentTypeError(
                f"no such file {module!r} (for {what} {text}); give the path of a .py file")
    elif not _findable(module):
        raise argparse.ArgumentTypeError(
            f"cannot import {module!r} for {what} {text}: no such module on the path or in "
            "the current folder")
    return text


def loader(function: str, what: str) -> Callable[[str], None]:
    """A loader for :class:`Named`: ``resolve.<function>(text, argument=what)``."""

    def load(text: str) -> None:
        from towers.allreduce.machinery import resolve

        try:
            getattr(resolve, function)(text, argument=what)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return load


def _algorithm_name(text: str) -> str:
    if ":" in text:
        return spec_found(text, "algorithm")
    known = (*ALGORITHMS, "noop")
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {text!r}{did_you_mean(text, known)}; choose from "
            f"{', '.join(ALGORITHMS)} or name your own as module:NAME")
    return text


_load_algorithm = loader("check", "algorithm")
algorithm = Named(_algorithm_name, _load_algorithm, "algorithm")

algorithm_or_collective = Named(
    lambda text: text if text in COLLECTIVES else _algorithm_name(text),
    _load_algorithm, "algorithm")


def algorithms(extra: Sequence[str] = ()) -> Named:
    """A comma list of :data:`algorithm` s, or of the ``extra`` names (``tf.*`` contenders)."""

    def parse(text: str) -> list[str]:
        return [name if name in extra else algorithm(name) for name in _items(text)]

    return Named(parse, _load_algorithm, "algorithms")


def _codec_name(text: str) -> str:
    if ":" in text:
        return spec_found(text, "codec")
    base = text.split("(", 1)[0].strip()
    if base not in CODECS:
        raise argparse.ArgumentTypeError(
            f"unknown codec {text!r}{did_you_mean(base, CODECS)}; registered: "
            f"{', '.join(CODECS)} (or name your own as module:NAME)")
    return text


codec = Named(_codec_name, loader("get_codec", "codec"), "codec")


def _model_name(text: str) -> str:
    if text in ("mlp", "conv"):
        return text
    if ":" in text:
        return spec_found(text, "model")
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from mlp, conv or "
                                     "module:fn, a factory of a built keras.Model)")


def _step_name(text: str) -> str:
    if text in REFERENCES:
        return text
    if text.startswith("towers:"):
        name = text.removeprefix("towers:")
        if not name or name in REFERENCES:
            raise argparse.ArgumentTypeError(
                f"expected an algorithm name after 'towers:', got {text!r}"
                + (f" ({name} is a tf.distribute reference: name it alone)" if name else ""))
        algorithm(name)
        return text
    return str(algorithm(text))  # a registered name or module:NAME that can be found


compared_step = Named(_step_name, lambda text: None if text.startswith("towers:")
                      else loader("imported", "step")(text), "step")
step = Named(lambda text: spec_found(text, "step"), loader("imported", "step"), "step")
model = Named(_model_name, loader("imported", "model"), "model")


def reducer(text: str) -> str:
    """A REDUCER's names, checked without TensorFlow."""
    head, at, after = text.strip().rpartition("@")
    head = head if at else after
    if at and after not in ALGORITHMS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown all-reduce {after!r} after @{did_you_mean(after, ALGORITHMS)}; "
            f"choose from {', '.join(ALGORITHMS)}")
    if ":" in head:
        spec_found(head, "reducer")
    elif (name := head.split("(", 1)[0].strip()) not in ALGORITHMS + CODECS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown {name!r}{did_you_mean(name, ALGORITHMS + CODECS)}; choose an "
            f"all-reduce ({', '.join(ALGORITHMS)}), a codec ({', '.join(CODECS)}) or module:NAME")
    return text


def _probe(folder: Path, text: str) -> None:
    """Create and remove a file in ``folder`` (``os.access`` says yes to /proc for root)."""
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
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no folder {str(path.parent)!r}")
    _probe(path.parent, text)
    return text


def output_prefix(text: str) -> str:
    """A path prefix whose ``.csv`` and ``.png`` files can be written."""
    output_file(text + ".png")
    output_file(text + ".csv")
    return text


def output_dir(text: str) -> Path:
    """A folder that is writable, or can be created (its nearest existing parent is)."""
    path = existing = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    while not existing.is_dir():
        if existing.exists() or existing == existing.parent:
            raise argparse.ArgumentTypeError(
                f"cannot create folder {text!r}: {existing} is not a folder")
        existing = existing.parent
    _probe(existing, text)
    return path
