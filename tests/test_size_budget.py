"""The size budget: no module over 500 lines, no function over 80, no folder over 15 modules
(docs/ARCHITECTURE.md, "Habits").

A module that passes ~400 lines or a function that passes ~50 is asking to be split by concept, and so
is a folder whose modules a newcomer cannot take in at a glance; the budget is the hard limit, checked
here so that nothing is split by hand after the fact.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("sbpflow", "actor_workers", "control_plane", "client")
GENERATED = "sbpflow/v1/"
MODULE_LINES = 500
FUNCTION_LINES = 80
FOLDER_MODULES = 15  # .py files directly in one folder, its __init__.py counted
FOLDER_ROOTS = (*FOLDERS, "tests", "examples", "bench")  # the code, its tests, the examples, the benchmarks


def sources() -> list[Path]:
    return [
        p
        for folder in FOLDERS
        for p in sorted((ROOT / folder).rglob("*.py"))
        if not p.relative_to(ROOT).as_posix().startswith(GENERATED)
    ]


def over_budget(path: Path) -> list[str]:
    text = path.read_text()
    rel = path.relative_to(ROOT).as_posix()
    out = []
    lines = text.count("\n")
    if lines > MODULE_LINES:
        out.append(f"{rel}: {lines} lines (budget {MODULE_LINES}): split it by concept")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > FUNCTION_LINES:
                out.append(f"{rel}:{node.lineno}: {node.name} is {n} lines (budget {FUNCTION_LINES})")
    return out


def test_every_module_and_function_is_within_the_budget() -> None:
    assert len(sources()) > 100  # the walk found the code
    bad = [line for p in sources() for line in over_budget(p)]
    assert not bad, "\n".join(bad)


def test_the_budget_check_finds_a_long_function_and_a_long_module(tmp_path: Path) -> None:
    probe = ROOT / "sbpflow" / "_size_probe_for_test.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    probe.write_text(f"def long():\n{body}\n" + "\n" * MODULE_LINES)
    try:
        found = over_budget(probe)
    finally:
        probe.unlink()
    assert len(found) == 2 and "long is 81 lines" in found[1]


def crowded() -> list[str]:
    """Every folder under :data:`FOLDER_ROOTS` (the generated code aside) over :data:`FOLDER_MODULES`."""
    counts: dict[str, int] = {}
    for root in FOLDER_ROOTS:
        for p in (ROOT / root).rglob("*.py"):
            folder = p.parent.relative_to(ROOT).as_posix()
            if not (folder + "/").startswith(GENERATED):
                counts[folder] = counts.get(folder, 0) + 1
    return [
        f"{folder}/: {n} modules (budget {FOLDER_MODULES}): group them into subpackages by concern"
        for folder, n in sorted(counts.items())
        if n > FOLDER_MODULES
    ]


def test_no_folder_holds_more_than_its_budget_of_modules() -> None:
    bad = crowded()
    assert not bad, "\n".join(bad)


def test_the_folder_check_finds_a_crowded_folder() -> None:
    folder = ROOT / "sbpflow" / "_crowded_probe_for_test"
    folder.mkdir()
    try:
        for i in range(FOLDER_MODULES + 1):
            (folder / f"m{i}.py").write_text("")
        found = crowded()
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    assert found == [
        f"sbpflow/_crowded_probe_for_test/: {FOLDER_MODULES + 1} modules (budget 15): "
        "group them into subpackages by concern"
    ]
