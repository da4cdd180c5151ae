"""The README's code runs as printed: "Add your own reduction", both blocks.

The blocks are read out of README.md, so an edit there that breaks them fails here.
``trainer = towers.TowerTrainer(..., all_reduce=...)`` lines are the reader's to
complete; the test completes them with a small model and checks the promise behind them:
star adds in tower order, as ``naive`` does, so training with it is bitwise the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import keras
import numpy as np

import towers
from tests.conftest import DEVICES
from towers.allreduce import ALGORITHMS

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"## {section}")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], re.S)


def _runnable(block: str) -> str:
    return "\n".join(line for line in block.splitlines() if "TowerTrainer(..." not in line)


def _train(all_reduce: object) -> list[np.ndarray]:
    def model() -> keras.Model:
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(3)])

    x = np.random.default_rng(0).normal(size=(11, 5)).astype(np.float32)
    y = np.arange(11) % 3
    trainer = towers.TowerTrainer(
        model, lambda: keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
        devices=DEVICES[:3], all_reduce=all_reduce, variables="replicated",
    )
    for _ in range(2):
        trainer.train_step(x, y)
    return trainer.get_weights()


def test_add_your_own_reduction_runs_as_printed(capsys) -> None:  # type: ignore[no-untyped-def]
    plain, registered = _blocks("Add your own reduction")
    scope: dict[str, object] = {"towers": towers}
    try:
        exec(_runnable(plain), scope)
        first = capsys.readouterr().out
        assert "PASS" in first and "bytes not checked" in first, first
        exec(_runnable(registered), scope)
        second = capsys.readouterr().out
        assert "PASS" in second and "not checked" not in second, second
        assert "star" in ALGORITHMS
        for got, want in zip(_train("star"), _train("naive"), strict=True):
            np.testing.assert_array_equal(got, want)
        for got, want in zip(_train(scope["star"]), _train("naive"), strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        ALGORITHMS.pop("star", None)


def test_the_mistake_count_is_the_matrix() -> None:
    """"docs/bad_inputs.md lists N mistakes": N is the executed matrix's length."""
    from tests.test_bad_inputs import CASES

    said = re.search(r"`docs/bad_inputs.md` lists (\d+) mistakes", README.read_text())
    assert said is not None and int(said.group(1)) == len(CASES)


def test_the_keras_block_runs_as_printed(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """"Keras: compile and fit": the block trains, saves and loads a TowerModel as printed."""
    block = _blocks("Keras: compile and fit")[0]  # the first: the quick tour
    # the block's first line starts the devices; the test session already has 8, so the
    # block gets 4 of them instead (the same call, after the runtime started, is refused)
    code = block.replace("devices = towers.simulate_devices(4)", "devices = DEVICES[:4]")
    assert code != block
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(150, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=150)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"DEVICES": DEVICES, "model": model, "x": x, "y": y}
    exec(code, scope)
    tm, history = scope["tm"], scope["history"]
    assert isinstance(tm, towers.TowerModel) and tm.trainer.devices == list(DEVICES[:4])
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history.history)  # type: ignore[attr-defined]
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert isinstance(loaded, towers.TowerModel)
    for got, want in zip(loaded.get_weights(), tm.get_weights(), strict=True):  # type: ignore[attr-defined]
        np.testing.assert_array_equal(got, want)


def test_every_picture_the_docs_show_is_in_the_repository() -> None:
    """A newcomer reads the README where it is hosted: every image it or a docs page
    links must be a file of the checkout (CI runs on a clean clone, so an untracked or
    ignored picture fails here)."""
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("*.md"))]
    linked = [(page, target) for page in pages
              for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text())]
    assert len(linked) >= 6  # the README alone shows six
    missing = [f"{page.name}: {target}" for page, target in linked
               if not target.startswith("http")
               and not (page.parent / target).resolve().is_file()]
    assert not missing, missing
