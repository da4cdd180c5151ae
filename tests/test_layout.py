"""The package's shape, as README's "Layout" and docs/architecture.md describe it.

Read from the source with ``ast`` (nothing of towers is imported for the shape checks):
the top level holds only the data-flow modules, no module imports one that imports it
back, and exactly one module applies gradients. The modules that moved have no shim:
their old names do not import.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import towers

PACKAGE = Path(towers.__file__).resolve().parent
DATA_FLOW = {"devices.py", "split.py", "tower.py", "placement.py", "step.py", "model.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every towers module ``path`` imports, anywhere in the file (lazy imports count)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    # A package importing its own children (re-exports) and a child importing its
    # package are not cycles between modules.
    family = {m for m in found if m.startswith(name + ".") or name.startswith(m + ".")}
    return {m for m in found - family if m in known and m != name}


def test_top_level_holds_only_the_data_flow() -> None:
    top = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert top == DATA_FLOW
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert {"allreduce", "training", "trace", "bench", "testing", "cli"} <= packages


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return False

    cycles = sorted(m for m in graph if reaches(m, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_one_module_applies_gradients() -> None:
    """The step exists once: only towers.step calls apply_gradients (bench's tf.distribute
    baselines aside, which are the reference's loops, not towers' step; and
    towers.guard.given, which applies a fresh copy of the optimizer to a 4×2 probe
    variable to learn whether its sparse and dense updates agree — a measurement, no step)."""
    applying = []
    for name, path in _modules().items():
        if name.startswith("towers.bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "apply_gradients":
                applying.append(name)
                break
    assert sorted(applying) == ["towers.guard.given", "towers.step"]


def test_no_import_shim_for_old_module_names() -> None:
    """No compatibility shims before 1.0: a moved module's callers moved with it."""
    assert not hasattr(towers, "MOVED")
    finders = [type(f).__module__ for f in sys.meta_path]
    assert not [m for m in finders if m.split(".")[0] == "towers"]
    for old in ("towers.trainer", "towers.checkpoint", "towers.costmodel", "towers.bench.cli"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    with pytest.raises(AttributeError, match="no attribute 'checkpoint'"):
        _ = towers.checkpoint  # type: ignore[attr-defined]


def test_imports_of_towers_modules_are_at_the_top() -> None:
    """A function-level import of a sibling is a cycle hidden from the cycle check; only the
    CLI (a fast ``--help``) defers any."""
    deferred = set()
    for name, path in _modules().items():
        if name.startswith("towers.cli"):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    module = node.module if isinstance(node, ast.ImportFrom) else None
                    if (module or "").startswith("towers"):
                        deferred.add(f"{name}:{fn.name}")
    assert not deferred, sorted(deferred)


def test_no_property_test_pins_its_example_count() -> None:
    """``--profile thorough`` must multiply every property test's examples: a decorator
    ``@settings(max_examples=<a number>)`` would pin it (use ``examples(ci=k)``)."""
    import re

    tests = Path(__file__).resolve().parent
    pinned = [
        f"{path.relative_to(tests)}:{i}"
        for path in tests.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"@settings\(.*max_examples=\d", line)
    ]
    assert not pinned, f"pinned example counts: {pinned}"


def _spine() -> str:
    """docs/architecture.md's drawing of one fit step (its first code block)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    return text.split("```", 2)[1]


def test_every_file_the_spine_names_exists() -> None:
    named = set(re.findall(r"towers/[\w/]+\.py", _spine()))
    assert len(named) >= 10
    assert not [p for p in sorted(named) if not (PACKAGE.parent / p).is_file()]


@pytest.mark.long
def test_the_spine_draws_every_module_one_fit_step_enters() -> None:
    """tools/step_profile.py profiles one ``TowerModel.fit`` step: every towers module it
    enters is a box of the spine, and they are at most a dozen (a reader's one sitting)."""
    script = PACKAGE.parent / "tools" / "step_profile.py"
    run = subprocess.run([sys.executable, str(script), "--list"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert run.returncode == 0, run.stderr[-2000:]
    entered = {line.split(" ", 1)[0] for line in run.stdout.splitlines()
               if line.endswith("]") and line.split(" ", 1)[0].endswith(".py")}
    assert 8 <= len(entered) <= 12, sorted(entered)
    spine = _spine()
    assert not [m for m in sorted(entered) if f"towers/{m}" not in spine]
