"""The size budget: no module over 500 lines, no function over 80 (docs/ARCHITECTURE.md, "Habits").

A module that passes ~400 lines or a function that passes ~50 is asking to be split by concept; the
budget is the hard limit, checked here so that nothing is split by hand after the fact.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("sbpflow", "actor_workers", "control_plane", "client")
GENERATED = "sbpflow/v1/"
MODULE_LINES = 500
FUNCTION_LINES = 80


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
