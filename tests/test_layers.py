"""The layering contract (docs/ARCHITECTURE.md, "Layers"): every import points down, never up.

    client/         front end, sf.Client, CLI
    control_plane/  compiler, launcher, services, store, status
    actor_workers/  runtime, transports, the Worker
    sbpflow/        core

Every import statement counts: at module level, inside a function, under ``TYPE_CHECKING`` or ``try``,
and string imports through ``importlib.import_module``. A deferred import does not make an upward
dependency acceptable; it only hides the cycle. The one exception is the facade ``sbpflow/__init__.py``,
which re-exports the user API from above so that ``import sbpflow as sf`` is all a user writes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> (dotted package it is installed as, rank: a layer may import only ranks <= its own)
LAYERS = {
    "sbpflow": ("sbpflow", 0),
    "actor_workers": ("sbpflow.actor_workers", 1),
    "control_plane": ("sbpflow.control_plane", 2),
    "client": ("sbpflow.client", 3),
}
FACADE = {"sbpflow/__init__.py"}  # may re-export from every layer
GENERATED = "sbpflow/v1/"


@dataclass(frozen=True)
class Import:
    file: str  # relative to the repository root
    line: int
    module: str
    deferred: bool  # not at the module's top level (in a function, a class, under if/try)


def layer_of(module: str) -> str | None:
    """The folder whose layer ``module`` belongs to (the longest matching package), or None."""
    best = None
    for folder, (package, _) in LAYERS.items():
        if module == package or module.startswith(package + "."):
            if best is None or len(package) > len(LAYERS[best][0]):
                best = folder
    return best


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # ``from sbpflow.control_plane import scheduler`` imports the submodule: count it as such
        return [f"{node.module}.{a.name}" for a in node.names]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def imports_of(path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    rel = path.relative_to(ROOT).as_posix()
    for node in ast.walk(tree):
        for module in _imported(node):
            yield Import(rel, getattr(node, "lineno", 0), module, id(node) not in top)


def all_imports() -> Iterator[tuple[str, Import]]:
    for folder in LAYERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED):
                for imp in imports_of(path):
                    yield folder, imp


def upward() -> list[str]:
    out = []
    for folder, imp in all_imports():
        to = layer_of(imp.module)
        if to is None or imp.file in FACADE:
            continue
        if LAYERS[to][1] > LAYERS[folder][1]:
            how = " (deferred)" if imp.deferred else ""
            out.append(f"{imp.file}:{imp.line}: {folder} imports {imp.module}{how}, a layer above it")
    return out


def test_no_layer_imports_a_layer_above_it() -> None:
    bad = upward()
    assert not bad, (
        "upward imports (move the code down, or pass what it needs as data through the Plan or a "
        "listener):\n" + "\n".join(bad)
    )


def test_the_contract_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The walker finds module-level, deferred, TYPE_CHECKING and importlib imports."""
    probe = ROOT / "sbpflow" / "_layers_probe_for_test.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "from sbpflow.control_plane import scheduler\n"
        "if TYPE_CHECKING:\n    from sbpflow.client.tensor import Tensor\n"
        "def f():\n    import sbpflow.actor_workers.worker\n"
        "    importlib.import_module('sbpflow.control_plane.launch.launcher')\n"
    )
    try:
        found = [u for u in upward() if "_layers_probe_for_test" in u]
    finally:
        probe.unlink()
    assert len(found) == 4, found
    assert sum("(deferred)" in f for f in found) == 3


@pytest.mark.parametrize("module, folder", [
    ("sbpflow.sbp", "sbpflow"),
    ("sbpflow.client.cli.main", "client"),
    ("sbpflow.control_plane.compiler.pipeline", "control_plane"),
    ("sbpflow.actor_workers.runtime", "actor_workers"),
    ("numpy", None),
])  # fmt: skip
def test_layer_of(module: str, folder: str | None) -> None:
    assert layer_of(module) == folder
