"""The step-through viewer (towers.trace.viewer) in a real headless browser.

Debian's Chromium opens the page from a file:// URL at ``#tick=2&press=next`` (the
page presses its own *next* button), and the DOM it dumps must show tick 3: every
chunk's ``data-held`` equal to the computed state after tick 3 and one send per
(src, dst) pair of that tick. A screenshot must be a PNG with something drawn.
Without Chromium (``apt-get install -y chromium``) the browser tests skip saying so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import DEVICES
from towers.trace.state import range_label, sends_by_tick, trace_state
from towers.trace.viewer import viewer_data, write_html

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    BROWSER is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)")
CHUNK = re.compile(r'<g class="chunk" data-tower="(\d+)" data-segment="(\d+)" data-held="([\d ]*)"')
SEND = re.compile(r'<g class="send" data-src="(\d+)" data-dst="(\d+)" data-ranges="([^"]*)"')


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert BROWSER is not None
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_page_is_self_contained(tmp_path: Path) -> None:
    state = trace_state("tree", DEVICES[:5])
    page = write_html(state, tmp_path / "tree.html").read_text()
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert re.findall(r"https?://[^\s'\"]+", page) == ["http://www.w3.org/2000/svg"] * 2
    data = viewer_data(state)
    assert len(data["states"]) == state.ticks + 1 and data["topology"]["kind"] == "tree"


@needs_browser
def test_stepping_in_a_browser_shows_the_computed_state(tmp_path: Path) -> None:
    state = trace_state("ring", DEVICES[:4])
    page = write_html(state, tmp_path / "ring.html")
    done = _chromium(tmp_path, "--dump-dom", f"{page.as_uri()}#tick=2&press=next")
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'id="status" data-tick="3"' in done.stdout, done.stdout[:2000]
    drawn = {(int(p), int(s)): {int(i) for i in held.split()}
             for p, s, held in CHUNK.findall(done.stdout)}
    assert drawn == {(p, s): set(held) for p, tower in enumerate(state.states[4])
                     for s, held in enumerate(tower)}
    sends = sorted((int(a), int(b), r) for a, b, r in SEND.findall(done.stdout))
    assert sends == sorted((src, dst, range_label(ranges))
                           for (tick, src, dst), ranges in sends_by_tick(state).items()
                           if tick == 3)


@needs_browser
@pytest.mark.parametrize(("fragment", "tick"), [
    ("tick=1&key=ArrowLeft", 0), ("tick=0&key=ArrowRight", 1), ("tick=3&key=End", 5),
    ("tick=2&key=Home", -1), ("tick=99", 5),
], ids=["left", "right", "end", "home", "clamped"])
def test_keys_step_through_the_ticks(fragment: str, tick: int, tmp_path: Path) -> None:
    page = write_html(trace_state("ring", DEVICES[:4]), tmp_path / "ring.html")
    done = _chromium(tmp_path, "--dump-dom", f"{page.as_uri()}#{fragment}")
    assert f'id="status" data-tick="{tick}"' in done.stdout, done.stderr[-2000:]


@needs_browser
def test_a_screenshot_shows_the_page(tmp_path: Path) -> None:
    page = write_html(trace_state("halving_doubling", DEVICES[:8]), tmp_path / "hd.html")
    shot = tmp_path / "viewer.png"
    done = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1300,560",
                     f"{page.as_uri()}#tick=1")
    assert done.returncode == 0, done.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (560, 1300)
    assert (pixels[..., :3].std(axis=2) > 0.2).mean() > 0.01  # coloured chunks, not a blank page


def test_the_command_writes_the_page_and_the_state_picture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from towers import cli

    page, png = tmp_path / "swing.html", tmp_path / "swing.png"
    code = cli.main(["trace", "swing", "--n", "6", "--no-png", "--html", str(page),
                     "--state", str(png)])
    assert code == 0
    out = capsys.readouterr().out
    assert "alpha 6 messages (cost formula: 6.0), complete at the end: True" in out
    assert page.read_text().count('"algorithm": "swing"') == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [
    ["trace", "ring", "--algorithm", "tree"],
    ["trace", "ring", "--html", "/no/such/dir/x.html"],
], ids=["two-algorithms", "missing-directory"])
def test_usage_errors_exit_2_before_any_work(argv: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from towers import cli

    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # found while parsing
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("disagree" in err or "--html: cannot write" in err)
