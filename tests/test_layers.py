"""The layering contract (docs/ARCHITECTURE.md, "Layers"): every import points down, never up, and no
module reaches itself through its imports.

    client/         front end, sf.Client, CLI
    control_plane/  service > status, profiling > launch > render, store > compiler
    actor_workers/  runtime, execution, transports, the Worker
    sbpflow/        core

Every import statement counts: at module level, inside a function, under ``TYPE_CHECKING`` or ``try``,
and string imports through ``importlib.import_module``. A deferred import does not make an upward
dependency or a cycle acceptable; it only hides it. The one exception to the layers is the facade
``sbpflow/__init__.py``, which names the user API of every layer (loaded on first use, from its table of
module names, which the cycle check reads as imports) so that ``import sbpflow as sf`` is all a user
writes.
"""

from __future__ import annotations

import ast
import sys
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
# The control plane's subpackages, ranked the same way: the compiler imports only the core; rendering
# and the store only the compiler; launching a compiled job runs it on the workers; profiling runs real
# jobs to measure this machine, and the status pages read the store and the launches; the services use
# them all. Subpackages of one rank import neither of each other.
CONTROL_PLANE = {
    "compiler": 0,
    "render": 1,
    "store": 1,
    "launch": 2,
    "generation": 3,
    "profiling": 3,
    "status": 3,
    "service": 4,
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


def sublayer_of(module: str) -> str | None:
    """The control-plane subpackage ``module`` belongs to, or None outside one."""
    prefix = LAYERS["control_plane"][0] + "."
    if not module.startswith(prefix):
        return None
    return module[len(prefix) :].split(".")[0]


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # ``from sbpflow.control_plane import launch`` imports the subpackage: count it as such
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


def sources() -> Iterator[tuple[str, Path]]:
    for folder in LAYERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not path.relative_to(ROOT).as_posix().startswith(GENERATED):
                yield folder, path


def all_imports() -> Iterator[tuple[str, Import]]:
    for folder, path in sources():
        for imp in imports_of(path):
            yield folder, imp


def upward() -> list[str]:
    out = []
    for folder, imp in all_imports():
        to = layer_of(imp.module)
        if to is None or imp.file in FACADE:
            continue
        how = " (deferred)" if imp.deferred else ""
        src = module_name(ROOT / imp.file)
        if LAYERS[to][1] > LAYERS[folder][1]:
            out.append(f"{imp.file}:{imp.line}: {folder} imports {imp.module}{how}, a layer above it")
            continue
        a, b = sublayer_of(src), sublayer_of(imp.module)
        if a in CONTROL_PLANE and b in CONTROL_PLANE and a != b and CONTROL_PLANE[b] >= CONTROL_PLANE[a]:
            where = "above" if CONTROL_PLANE[b] > CONTROL_PLANE[a] else "beside"
            out.append(
                f"{imp.file}:{imp.line}: control_plane/{a} imports {imp.module}{how}, a part {where} it"
            )
    return out


def test_no_layer_imports_a_layer_above_it() -> None:
    bad = upward()
    assert not bad, (
        "upward imports (move the code down, or pass what it needs as data through the Plan, a Protocol "
        "or a listener):\n" + "\n".join(bad)
    )


# ---- cycles ------------------------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package, _ = LAYERS[parts[0]]
    rest = parts[1:-1] if parts[-1] == "__init__" else parts[1:]
    return ".".join([package, *rest])


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a import b`` names module ``a.b`` where there is
    one, else ``a``); the facade's table of module names counts as its imports."""
    paths = {module_name(p): p for _, p in sources()}

    def resolve(name: str) -> str | None:
        if name == "sbpflow.v1" or name.startswith("sbpflow.v1."):  # generated protobuf code: a leaf
            return None
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[str, set[str]] = {}
    for module, path in paths.items():
        found = {imp.module for imp in imports_of(path)}
        if path.relative_to(ROOT).as_posix() in FACADE:
            found |= {
                n.value
                for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in paths
            }
        out[module] = {m for m in map(resolve, found) if m is not None and m != module}
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each in a cycle's order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others() -> None:
    found = cycles(graph())
    assert not found, (
        "import cycles, deferred and TYPE_CHECKING imports included (split out what both sides need, or "
        "have one side take the other through a Protocol or as data):\n"
        + "\n".join(" <-> ".join(c) for c in found)
    )


def test_the_cycle_check_sees_a_cycle_through_a_deferred_import() -> None:
    g = graph()
    g["sbpflow.sbp"] = g["sbpflow.sbp"] | {"sbpflow.placement"}  # placement imports errors only
    g["sbpflow.errors"] = g["sbpflow.errors"] | {"sbpflow.sbp"}
    assert ["sbpflow.errors", "sbpflow.placement", "sbpflow.sbp"] in cycles(g)
    assert "sbpflow.client.nn" in graph()["sbpflow"]  # the facade's table of names


def test_no_module_imports_another_ones_private_names() -> None:
    """A name with a leading underscore is its module's own: another that needs it gets a public name
    (or the code moves), so a module's private names can change without looking elsewhere."""
    bad = []
    for _, path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sbpflow"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not bad, "private names imported from another module (make them public):\n" + "\n".join(bad)


def test_the_compiler_imports_only_the_core() -> None:
    """The compiler is a pure Job -> Plan layer: nothing that runs, measures, serves or draws."""
    bad = [
        f"{imp.file}:{imp.line}: {imp.module}"
        for folder, imp in all_imports()
        if imp.file.startswith("control_plane/compiler/")
        and layer_of(imp.module) not in (None, "sbpflow")
        and sublayer_of(imp.module) != "compiler"
    ]
    assert not bad, "the compiler imports beyond the core:\n" + "\n".join(bad)


# ---- the walker itself ---------------------------------------------------------------------------------


def test_the_contract_sees_every_kind_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walker finds module-level, deferred, TYPE_CHECKING and importlib imports, and a control-plane
    part importing one above it. The probes are a tree of their own: written into the checkout, they were
    seen (and then missed, mid-read) by the tests that walk it on the other xdist worker."""
    probe = tmp_path / "sbpflow" / "_layers_probe_for_test.py"
    up = tmp_path / "control_plane" / "compiler" / "_layers_probe_for_test.py"
    for p in (probe, up):
        p.parent.mkdir(parents=True)
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "import importlib\n"
        "from sbpflow.control_plane import launch\n"
        "if TYPE_CHECKING:\n    from sbpflow.client.tensor import Tensor\n"
        "def f():\n    import sbpflow.actor_workers.worker\n"
        "    importlib.import_module('sbpflow.control_plane.launch.launcher')\n"
    )
    up.write_text("def f():\n    from sbpflow.control_plane.profiling import pricing\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = [u for u in upward() if "_layers_probe_for_test" in u]
    assert len(found) == 5, found
    assert sum("(deferred)" in f for f in found) == 4
    assert any("control_plane/compiler imports sbpflow.control_plane.profiling.pricing" in f for f in found)


@pytest.mark.parametrize("module, folder", [
    ("sbpflow.sbp", "sbpflow"),
    ("sbpflow.client.cli.main", "client"),
    ("sbpflow.control_plane.compiler.pipeline", "control_plane"),
    ("sbpflow.actor_workers.runtime", "actor_workers"),
    ("numpy", None),
])  # fmt: skip
def test_layer_of(module: str, folder: str | None) -> None:
    assert layer_of(module) == folder


def test_every_control_plane_subpackage_is_ranked() -> None:
    subs = {p.name for p in (ROOT / "control_plane").iterdir() if (p / "__init__.py").is_file()}
    assert subs == set(CONTROL_PLANE), "rank the new subpackage in CONTROL_PLANE (and docs/ARCHITECTURE.md)"
    flat = sorted(p.name for p in (ROOT / "control_plane").glob("*.py") if p.name != "__init__.py")
    assert not flat, f"control_plane/ holds modules outside its parts: {flat}; put each in the part it serves"
