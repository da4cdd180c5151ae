"""The README a newcomer finishes, and the docs' code and claims it points to.

Every ```python block of README.md runs as pasted in a fresh Python process (the
repository's root as working directory, as a reader who cloned it runs it) and prints
what the README shows it printing. The README stays short (≤ 300 lines), shows the step
as a picture in its first screen, and every docs page it links exists.

The reference material lives in docs/: docs/step.md's blocks run in a fresh process too;
"Add your own reduction" (docs/algorithms.md) and the Keras quick tour (docs/keras.md) run
in this process as printed; the mistake count of
docs/reliability.md is the executed matrix's length; every picture a page shows is a file
of the checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import towers
from tests.conftest import DEVICES
from towers.allreduce import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _readme_blocks() -> list[str]:
    return PYTHON_BLOCK.findall(README.read_text())


def _blocks(page: Path, section: str) -> list[str]:
    """The ```python blocks of one ``## section`` of a docs page."""
    text = page.read_text()
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    return PYTHON_BLOCK.findall(text[start:end if end > 0 else None])


# what each README block must print (a pattern per line the README shows), in block order
PRINTS = [
    [r"fit: val_accuracy (0\.[89]\d|1\.00)", r"train_step: loss 0\.\d+"],
    [r"PASS: star \(\d+ examples run\)", r"loss with star: \[[\d., ]+\]"],
    [r"my step against MirroredStrategy: ok",
     r"FIRST DIVERGENCE: step 1, variable \S+/kernel",
     r"\|Δ\| = \S+ > bound \S+"],
]


def test_the_readme_is_short_and_shows_the_step_first() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    first = "\n".join(lines[:60])
    assert re.search(r"!\[[^\]]*\]\(docs/[^)]+\.png\)", first), "no picture in the first 60 lines"
    drawing = first[first.index("```\n"):]  # the step drawn: its four phases, in order
    phases = [drawing.index(p) for p in ("split", "forward_backward", "reduce", "apply")]
    assert phases == sorted(phases)


def test_the_readme_gives_the_quick_start_commands() -> None:
    text = README.read_text()
    for command in ('pip install -e ".[test]" && python -m towers train',
                    "python -m pytest ", "python -m pytest -m long"):
        assert command in text, command


def test_every_docs_link_in_the_readme_exists() -> None:
    links = re.findall(r"\]\((docs/[^)#\s]+)", README.read_text())
    assert len(links) >= 15
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing


def test_the_readme_has_one_block_per_path() -> None:
    assert len(_readme_blocks()) == len(PRINTS)


@pytest.mark.long  # 35 s; the blocks also run in process as printed (the tests above)
@pytest.mark.parametrize("index", range(len(PRINTS)))
def test_each_readme_block_runs_as_pasted_in_a_fresh_process(index: int) -> None:
    out = _run(_readme_blocks()[index])
    for pattern in PRINTS[index]:
        assert re.search(pattern, out), (pattern, out)


def _run(code: str) -> str:
    """``code`` in a fresh Python process from the repository's root; its stdout."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("PYTHONPATH", None)  # what a reader has: the checkout as working directory
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.long  # slow (>6 s): the fast suite's 10 minutes; CI's second command runs it
def test_the_step_page_runs_as_pasted_in_a_fresh_process() -> None:
    """docs/step.md's blocks, in order in one process: the step, its phases, tf.data."""
    code = "".join(PYTHON_BLOCK.findall((DOCS / "step.md").read_text()))
    out = _run(code)
    assert "examples per tower: [3, 3, 3, 1]" in out, out  # MirroredStrategy's split
    assert "last batch per tower: [1, 1, 0, 0]" in out, out


def test_each_readme_block_shows_what_it_prints() -> None:
    """The output shown after each block is what the block's pattern matches."""
    text = README.read_text()
    shown = re.findall(r"```python\n.*?```\n\n```\n(.*?)```", text, re.S)
    assert len(shown) == len(PRINTS)
    for out, patterns in zip(shown, PRINTS, strict=True):
        for pattern in patterns:
            assert re.search(pattern, out), (pattern, out)


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
    """docs/algorithms.md "Add your own reduction": star adds in tower order, as ``naive``
    does, so training with it is bitwise the same. ``TowerTrainer(..., all_reduce=...)``
    lines are the reader's to complete; the test completes them."""
    plain, registered = _blocks(DOCS / "algorithms.md", "Add your own reduction")
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
    """"docs/bad_inputs.md lists N mistakes" (docs/reliability.md): N is the executed
    matrix's length."""
    from tests.test_bad_inputs import CASES

    text = (DOCS / "reliability.md").read_text()
    said = re.search(r"`docs/bad_inputs.md` lists (\d+) mistakes", text)
    assert said is not None and int(said.group(1)) == len(CASES)


def test_the_keras_block_runs_as_printed(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """docs/keras.md's quick tour trains, saves and loads a TowerModel as printed."""
    block = _blocks(DOCS / "keras.md", "Keras: compile and fit")[0]
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
    pages = [README, *sorted(DOCS.glob("*.md"))]
    linked = [(page, target) for page in pages
              for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text())]
    assert len(linked) >= 7  # the README's ring, and docs/pictures.md's and codecs.md's
    missing = [f"{page.name}: {target}" for page, target in linked
               if not target.startswith("http")
               and not (page.parent / target).resolve().is_file()]
    assert not missing, missing


def test_every_link_between_docs_pages_exists() -> None:
    """A page moved or renamed leaves no dead relative link behind."""
    dead = [f"{page.name}: {target}" for page in sorted(DOCS.glob("*.md"))
            for target in re.findall(r"\]\(([^)#\s]+\.(?:md|ipynb))\)", page.read_text())
            if not target.startswith("http") and not (page.parent / target).resolve().is_file()]
    assert not dead, dead


def test_the_readme_algorithm_table_is_the_registry_and_the_contract() -> None:
    """The README's table of built-in algorithms names every registered algorithm once and
    the contract's dtypes and ops; the behaviour of each cell is proven where it lives
    (every count in tests/allreduce/test_any_tower_count.py, gradients in
    tests/allreduce/test_gradients.py, dtypes and ops in tests/allreduce/machinery/)."""
    from towers.allreduce.machinery.base import ALL_OPS, DTYPES

    text = README.read_text()
    table = text[text.index("| algorithms | towers |"):].split("\n\n")[0].splitlines()[2:]
    names = [n for row in table for n in re.findall(r"`(\w+)`", row.split("|")[1])]
    assert sorted(names) == sorted(ALGORITHMS), names
    first = [cell.strip() for cell in table[0].split("|")[1:-1]]
    assert first[1] == "any n ≥ 1"
    assert first[2].split() == [d.name for d in DTYPES]
    assert re.findall(r"[a-z]+(?= \(floats\)|,|$)", first[3]) == list(ALL_OPS), first[3]
