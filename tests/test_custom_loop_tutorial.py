"""examples/custom_loop_tutorial.py: the ported tutorial step, tested with towers.testing's plugin.

The correct port passes against towers (``semantics="mirrored"``) for SGD
and Adam, each under its derived bound (``sgd_step_bound``, the tracked Adam bound of
``towers.testing.bounds.optimizers``); the planted weighting bug fails, and the
assertion's message names the step, the variable and both values; towers' default
divisor against the tutorial's fails on the uneven last batch, and the message names it
and the setting that reproduces MirroredStrategy's semantics.
The functions run in this process (the suite's 8 logical devices); the script itself
prints the same reports (``python examples/custom_loop_tutorial.py [--bug]``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from examples.custom_loop_tutorial import towers_step, tutorial_batches, your_step
from tests.conftest import DEVICES
from towers.testing.plugin import steps_match  # noqa: F401  (the plugin's fixture, used below)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_ported_tutorial_matches_towers(optimizer: str, steps_match) -> None:  # noqa: F811
    devices = DEVICES[:4]
    report = steps_match(towers_step(devices, optimizer), your_step(devices, optimizer),
                         tutorial_batches(2))  # fmt: skip
    assert max(r.max_diff for r in report.rows) > 0  # the two differ somewhere: it ran
    derived = "sgd_step_bound" if optimizer == "sgd" else "UpdateBounds"
    assert report.bound.startswith(derived), report.bound


@pytest.mark.long
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_planted_weighting_bug_fails_naming_step_variable_and_values(
    optimizer: str, steps_match  # noqa: F811
) -> None:
    devices = DEVICES[:4]
    ours = towers_step(devices, optimizer)
    with pytest.raises(AssertionError) as failed:
        steps_match(ours, your_step(devices, optimizer, bug=True), tutorial_batches(2))
    text = str(failed.value)
    names = [v.path for v in ours.model.trainable_variables]
    found = re.search(r"FIRST DIVERGENCE: step (\d+), variable (\S+) ", text)
    assert found is not None and found.group(1) == "1" and found.group(2) in names, text
    values = re.search(r"A = (\S+)  B = (\S+)  \|Δ\| = (\S+) > bound (\S+)", text)
    assert values is not None, text
    a, b, diff, bound = (float(v) for v in values.groups())
    assert a != b and diff > 100 * bound > 0
    assert "possible causes" not in text  # an even batch, no clipping, no BatchNorm: no hint


def test_towers_default_against_the_tutorial_names_the_uneven_batch_and_the_setting(
    steps_match,  # noqa: F811
) -> None:
    """The tutorial's divisor (shard × replicas) against towers' default (the global batch):
    the uneven last batch parts them, and the report says so and names the setting."""
    devices = DEVICES[:4]
    with pytest.raises(AssertionError) as failed:
        steps_match(towers_step(devices, "sgd", "one_device"), your_step(devices, "sgd"),
                    tutorial_batches(2))  # fmt: skip
    text = " ".join(str(failed.value).split())
    assert "FIRST DIVERGENCE: step 2," in text, text
    assert ("uneven batch: step 2's batch of 10 splits 3+3+3+1 over 4 towers and is shorter "
            "than the largest batch (64)") in text, text
    assert "A divides each tower's loss sum by 10 (the global batch)" in text
    assert 'the setting: TowerTrainer(..., semantics="mirrored")' in text


def test_the_example_says_what_it_teaches_and_simulates_devices_first() -> None:
    source = (ROOT / "examples" / "custom_loop_tutorial.py").read_text()
    assert source.startswith('"""') and "What it teaches" in source
    main = source[source.index("def main"):]
    assert "import tensorflow" not in main[: main.index("towers.simulate_devices(")]
    top_level = [line for line in source.splitlines() if line.startswith(("import", "from"))]
    assert not any("tensorflow" in line or "keras" in line for line in top_level)
