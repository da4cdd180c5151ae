"""What a checkpoint holds, written beside its values, and the check a restore makes of it.

Restored by position, ``SGD(momentum=0.9)``'s momentum would become an ``RMSprop``'s mean
square: every checkpoint carries a JSON record of its trainer (placement, replicas, optimizer
and hyperparameters, model and slot variables, all-reduce), compared on restore; what may
differ and what is refused: docs/checkpoints.md.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.registry import algorithm_name
from towers.guard.errors import CheckpointError
from towers.training.protocol import Trainer

__all__ = ["FORMAT", "KEY", "MISMATCH", "READ_ERRORS", "Record", "check", "describe",
           "learning_rate_note", "mismatch", "record"]

FORMAT = 1
"""The record's layout version; a checkpoint of another version is refused."""
KEY = "record/.ATTRIBUTES/py_state"
"""Where a checkpoint (:func:`towers.training.checkpoint.checkpoint`) keeps the record."""
_SUFFIX = re.compile(r"_\d+(?=[_/]|$)")
READ_ERRORS = (tf.errors.OpError, ValueError, IndexError, OSError, RuntimeError)
"""What reading a damaged or foreign checkpoint raises."""
MISMATCH = "does not match this trainer: "


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists, odd objects their repr)."""
    return json.loads(json.dumps(value, default=repr, sort_keys=True))


def _entry(variable: Any) -> list[Any]:
    """``[path, shape, dtype]``; the path without Keras' suffixes (``dense_3``: ``dense``)."""
    path = _SUFFIX.sub("", str(getattr(variable, "path", None) or variable.name))
    return [path, [int(d) for d in variable.shape], tf.as_dtype(variable.dtype).name]


def _optimizer(optimizer: Any) -> dict[str, Any]:
    """Class, hyperparameters (the learning rate apart: it is state) and inner optimizer."""
    config = _plain(optimizer.get_config())
    config.pop("name", None)
    config.pop("inner_optimizer", None)
    rate = config.get("learning_rate")
    rate = config.pop("learning_rate") if isinstance(rate, int | float) else None
    inner = getattr(optimizer, "inner_optimizer", None)
    defaults = {
        name: p.default for name, p in inspect.signature(type(optimizer)).parameters.items()
        if p.default is not inspect.Parameter.empty}  # fmt: skip
    return {
        "class": type(optimizer).__name__, "config": config, "learning_rate": rate,
        "defaults": _plain(defaults), "inner": None if inner is None else _optimizer(inner),
    }  # fmt: skip


def _all_reduce(algorithm: Any) -> dict[str, Any]:
    """The all-reduce's identity (its codec's too) and its state's shapes."""
    name = algorithm_name(algorithm)
    if hasattr(algorithm, "codec"):
        inner = algorithm_name(getattr(algorithm, "algorithm", None))
        name = f"{name}({inner}, {algorithm.codec!r}, decode={getattr(algorithm, 'decode', '')!r})"
    state = list(algorithm.variables) if isinstance(algorithm, tf.Module) else []
    return {"name": name, "state": [_entry(v)[1:] for v in state]}


def record(trainer: Trainer) -> dict[str, Any]:
    """What a checkpoint of ``trainer`` holds (JSON-serializable)."""
    return {
        "format": FORMAT, "placement": getattr(getattr(trainer, "placement", None), "name", None),
        "towers": len(trainer.devices), "replicas": len(trainer.replicas),
        "model": [[*_entry(v), "trainable" if v.trainable else "non-trainable"]
                  for v in trainer.model.variables],
        "optimizer": _optimizer(trainer.optimizer),
        "slots": [[_entry(v) for v in r.optimizer.variables] for r in trainer.replicas],
        "all_reduce": _all_reduce(trainer.algorithm)}  # fmt: skip


def describe(optimizer: dict[str, Any]) -> str:
    """``SGD (momentum=0.9)``: the class and the hyperparameters set to other than defaults."""
    config = dict(optimizer["config"])
    if optimizer.get("learning_rate") is not None:
        config["learning_rate"] = optimizer["learning_rate"]
    defaults = optimizer.get("defaults", {})
    shown = [
        f"{k}={_fmt(v)}" for k, v in sorted(config.items())
        if k not in defaults or _fmt(defaults[k]) != _fmt(v)]  # fmt: skip
    text = optimizer["class"] + (f" ({', '.join(shown)})" if shown else "")
    if optimizer.get("inner") is not None:
        text += f" of {describe(optimizer['inner'])}"
    return text


def _fmt(value: Any) -> str:
    return f"{value:.7g}" if isinstance(value, float) else repr(value)


def _classes(optimizer: dict[str, Any] | None) -> list[str]:
    return [] if optimizer is None else [optimizer["class"], *_classes(optimizer["inner"])]


def _config_diff(saved: dict[str, Any] | None, mine: dict[str, Any] | None) -> list[str]:
    if saved is None or mine is None:
        return []
    a, b = saved["config"], mine["config"]
    found = [f"{k}={_fmt(a.get(k))} in the checkpoint, {_fmt(b.get(k))} here"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if (saved["learning_rate"] is None) != (mine["learning_rate"] is None):
        found.append("a learning-rate schedule on one side, a fixed rate on the other")
    return found + _config_diff(saved["inner"], mine["inner"])


def _entries(what: str, saved: list[Any], mine: list[Any]) -> str | None:
    """The first difference of two variable lists, in words (None when equal)."""
    if saved == mine:
        return None
    for k, (a, b) in enumerate(zip(saved, mine)):
        if a != b:
            return f"{what} {k}: {_show(a)} in the checkpoint, {_show(b)} here"
    return f"{len(saved)} {what} in the checkpoint, {len(mine)} here"


def _show(entry: list[Any]) -> str:
    """``dense/kernel float32[64, 10]`` (``(non-trainable)`` too, for model variables)."""
    extra = " (non-trainable)" if entry[3:] == ["non-trainable"] else ""
    return f"{entry[0]} {entry[2]}{entry[1]}{extra}"


def mismatch(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """Why a checkpoint recorded as ``saved`` must not restore into ``mine`` (one sentence
    naming the first difference and what to build instead), or None."""
    if saved.get("format") != FORMAT:
        return f"its record has format {saved.get('format')!r}, this towers reads {FORMAT}"
    if saved["placement"] != mine["placement"]:
        return (f"checkpoint holds variables={saved['placement']!r}, trainer has "
                f"variables={mine['placement']!r}: restore into a trainer built with the "
                "same placement")  # fmt: skip
    if saved["replicas"] != mine["replicas"]:
        return (f"checkpoint holds {saved['replicas']} replicas (variables="
                f"{saved['placement']!r} over {saved['towers']} towers), trainer has "
                f"{mine['replicas']} ({mine['towers']} towers): restore into a trainer with "
                f"{saved['towers']} towers (a checkpoint is not re-sharded)")  # fmt: skip
    ours, theirs = saved["optimizer"], mine["optimizer"]
    held = f"checkpoint holds optimizer {describe(ours)}, trainer has {describe(theirs)}"
    if _classes(ours) != _classes(theirs):
        return f"{held}: restore into a trainer built with the same optimizer class"
    if diff := _config_diff(ours, theirs):
        return (f"{held} ({'; '.join(diff)}): build the trainer's optimizer with the "
                "checkpoint's hyperparameters")  # fmt: skip
    if problem := _entries("model variable", saved["model"], mine["model"]):
        return f"{problem}: restore into a trainer built with the same model"
    for k, (a, b) in enumerate(zip(saved["slots"], mine["slots"])):
        if problem := _entries(f"replica {k}'s optimizer variable", a, b):
            return f"{problem}: restore into a trainer built with the same optimizer and model"
    ours, theirs = saved["all_reduce"], mine["all_reduce"]
    if ours["name"] == theirs["name"] or not (ours["state"] or theirs["state"]):
        return None
    return (f"checkpoint holds all-reduce {ours['name']} ({len(ours['state'])} state values), "
            f"trainer has {theirs['name']} ({len(theirs['state'])}): restore into a trainer "
            "built with the same all-reduce and codec")  # fmt: skip


def learning_rate_note(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """A sentence when the restore replaces the trainer's (fixed) learning rate by another."""
    a, b = saved["optimizer"], mine["optimizer"]
    while a["learning_rate"] is None and a["inner"] is not None and b["inner"] is not None:
        a, b = a["inner"], b["inner"]
    if None in (a["learning_rate"], b["learning_rate"]) or a["learning_rate"] == b["learning_rate"]:
        return None
    return (f"the learning rate is now the checkpoint's, {_fmt(a['learning_rate'])}; the "
            f"trainer was built with {_fmt(b['learning_rate'])}. To train at the trainer's rate, "
            "assign it to every replica's optimizer after the restore (for r in "
            "trainer.replicas: r.optimizer.learning_rate.assign(rate))")  # fmt: skip


class Record(tf.train.experimental.PythonState):
    """The trainer's record as a string in the bundle; read back by :func:`check`, not here."""

    def __init__(self, trainer: Trainer) -> None:
        self.text = json.dumps(record(trainer), sort_keys=True)

    def serialize(self) -> str:
        return self.text

    def deserialize(self, string_value: Any) -> None:
        pass


def check(reader: Any, path: str, trainer: Trainer) -> str | None:
    """Compare the record in checkpoint ``path`` with ``trainer``'s; return
    :func:`learning_rate_note`'s sentence, or None (``CheckpointError``: none, or a mismatch)."""
    try:
        saved = json.loads(reader.get_tensor(KEY))
    except (*READ_ERRORS, TypeError) as err:
        if reader.has_tensor(KEY):
            raise CheckpointError(path, f"its record cannot be read ({err})") from err
        raise CheckpointError(
            path, "it holds no record of the trainer that wrote it (saved by a towers "
            "before checkpoints recorded their optimizer, model and placement), so what its "
            "values mean cannot be checked: it is refused; save it again with this version",
        ) from None  # fmt: skip
    mine = record(trainer)
    problem = mismatch(saved, mine)
    if problem:
        raise CheckpointError(path, MISMATCH + problem)
    return learning_rate_note(saved, mine)
