"""towers.allreduce.machinery.resolve: one grammar for every typed name.

A user's ``module:NAME`` wherever an all-reduce is named (the trainer, TowerModel and its
saved config, the wrappers), as on the command line; and, drawn by Hypothesis, every valid
spec resolving to the same object through every entry point (library, command line,
study, ``compressed``), every near miss of a registered name answered with "did you
mean", and junk refused with a ValueError naming the argument."""

from __future__ import annotations

import argparse
from pathlib import Path

import keras
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import towers
from tests.conftest import DEVICES, examples
from towers import cli
from towers.allreduce import ALGORITHMS, CODECS, compressed, get, hierarchical
from towers.allreduce.machinery.registry import Configured
from towers.allreduce.machinery.resolve import check, get_codec, label, parse
from towers.bench.study import build
from towers.cli import arguments

LOSS = "sparse_categorical_crossentropy"


def _net() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(5, "tanh")(inputs)))


def _weights(all_reduce: object, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(10, 4)).astype("f4"), rng.integers(0, 3, size=10)
    trainer = towers.TowerTrainer(_net, keras.optimizers.SGD(0.1), LOSS, devices=DEVICES[:n],
                                  variables="replicated", all_reduce=all_reduce)  # fmt: skip
    for _ in range(2):
        trainer.train_step(x, y)
    return trainer.get_weights()


@pytest.mark.long
@pytest.mark.parametrize("n", [1, 3, 5])
def test_a_trainer_takes_module_name_for_an_algorithm_or_its_factory(user_module: str,
                                                                     n: int) -> None:
    star, made = get(f"{user_module}:star"), get(f"{user_module}:make_star")
    assert star is made and star.__name__ == "star"
    # the star adds in tower order on one device, as naive does: bitwise
    for a, b in zip(_weights(f"{user_module}:star", n), _weights("naive", n), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.long
def test_a_wrapper_takes_module_name_for_its_inner_algorithm(user_module: str) -> None:
    got = _weights(hierarchical(f"{user_module}:star", "ring", group_size=2), 4)
    want = _weights(hierarchical("naive", "ring", group_size=2), 4)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_tower_model_saves_and_loads_its_module_name(user_module: str, tmp_path: Path) -> None:
    tm = towers.TowerModel(_net(), devices=DEVICES[:3], all_reduce=f"{user_module}:star",
                           variables="replicated")  # fmt: skip
    tm.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    tm.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.options.all_reduce == f"{user_module}:star"
    assert loaded.trainer.algorithm is get(f"{user_module}:star")


@pytest.mark.parametrize(("spec", "error", "match"), [
    ("user_star:SHOUT", ValueError, "all_reduce user_star:SHOUT is a str, not an all-reduce"),
    ("user_star:nothing", ValueError, "has no 'nothing'"),
    ("no_such_module_here:star", ValueError, "cannot import 'no_such_module_here'"),
])  # fmt: skip
def test_a_bad_module_name_is_refused_at_construction(user_module: str, spec: str,
                                                      error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _weights(spec, 2)


def _same(a: object, b: object) -> bool:
    """One algorithm: the same object, or the same record with the same parameters."""
    if isinstance(a, Configured) and isinstance(b, Configured):
        return a.algorithm is b.algorithm and dict(a.params) == dict(b.params)
    return a is b


NAMES = sorted([*ALGORITHMS, "noop"])
CODEC_SPECS = st.one_of(
    st.sampled_from(["identity", "fp16", "bf16", "topk", "powersgd"]),
    st.floats(0.001, 1.0).map(lambda r: f"topk({r!r})"),
    st.integers(1, 8).map(lambda r: f"powersgd({r})"),
    st.integers(1, 8).map(lambda r: f"powersgd({r}, False)"),
)


@settings(max_examples=examples(ci=15), deadline=None)
@given(name=st.sampled_from(NAMES), spelled=st.sampled_from(["name", "module"]))
def test_an_algorithm_resolves_alike_through_every_entry_point(name: str, spelled: str) -> None:
    spec = name if spelled == "name" or name == "noop" else f"towers.allreduce:{name}"
    want = get(name)
    assert _same(get(spec), want) and _same(get(spec, argument="algorithm"), want)
    assert check(spec) in (name, getattr(towers.allreduce, name, None))
    assert arguments.algorithm(spec) == spec  # the command line's type takes it as typed
    assert cli.parsers()[0].parse_args(["check", spec]).algorithm == spec
    parsed = parse(spec)  # a study
    assert (parsed.algorithm, parsed.codec, label(spec)) == (spec, None, spec)
    reducer, counted = build(parsed, DEVICES[:2])
    assert counted is reducer and _same(counted.algorithm, want)


@settings(max_examples=examples(ci=15), deadline=None)
@given(codec=CODEC_SPECS, over=st.sampled_from(["", "@tree", "@ring", "@naive"]))
def test_a_codec_spec_resolves_alike_through_every_entry_point(codec: str, over: str) -> None:
    want = get_codec(codec)
    assert get_codec(codec) == want and get_codec(codec) is not want  # fresh state each time
    algorithm = over[1:] or "ring"
    made = compressed(algorithm, codec)
    assert made.codec == want and _same(made.algorithm, get(algorithm))
    assert arguments.codec(codec) == codec
    assert cli.parsers()[0].parse_args(["train", "--codec", codec]).codec == codec
    spec = parse(codec + over)
    assert (spec.algorithm, spec.codec) == (algorithm, codec)
    reducer, counted = build(spec, DEVICES[:2])
    assert reducer.codec == want and reducer.decode == "everywhere"
    assert counted is not None and _same(counted.algorithm, get(algorithm))


def _near_miss(name: str, data: st.DataObject) -> str:
    """``name`` with one typo: a letter dropped, doubled, changed, or two swapped."""
    i = data.draw(st.integers(0, len(name) - 1))
    letter = data.draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789_"))
    edit = data.draw(st.sampled_from(["drop", "double", "change", "swap", "upper"]))
    if edit == "drop":
        return name[:i] + name[i + 1:]
    if edit == "double":
        return name[:i] + name[i] + name[i:]
    if edit == "change":
        return name[:i] + letter + name[i + 1:]
    if edit == "swap" and i + 1 < len(name):
        return name[:i] + name[i + 1] + name[i] + name[i + 2:]
    return name.upper()


@settings(max_examples=examples(ci=40), deadline=None)
@given(data=st.data())
def test_a_near_miss_gets_a_did_you_mean(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["all_reduce", "codec"]))
    names = NAMES if kind == "all_reduce" else sorted(CODECS)
    name = data.draw(st.sampled_from(names))
    typo = _near_miss(name, data)
    assume(typo and typo not in NAMES and typo not in CODECS)
    calls = ([get, lambda t: get(t, argument="algorithm"), arguments.algorithm]
             if kind == "all_reduce" else [get_codec, arguments.codec])
    for call in [*calls, parse]:
        with pytest.raises((ValueError, argparse.ArgumentTypeError)) as info:
            call(typo)
        message = str(info.value)
        assert "unknown " in message and f"{typo!r} (did you mean " in message, message
        suggested = message.split("(did you mean ", 1)[1].split("?)", 1)[0]
        assert repr(name) in suggested.split(" or "), (typo, message)


@settings(max_examples=examples(ci=40), deadline=None)
@given(text=st.text(alphabet="abcdefgnoprstu_0123456789()@,.' ", max_size=14))
def test_junk_is_a_value_error_naming_the_argument(text: str) -> None:
    for argument, call in [("all_reduce", get), ("codec", get_codec), ("reducer", parse)]:
        try:
            call(text)
        except ValueError as err:
            assert argument in str(err) or "all_reduce" in str(err), (text, str(err))
