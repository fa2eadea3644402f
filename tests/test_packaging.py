"""The hand-written package list in pyproject.toml must match the tree, or a wheel silently drops code."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {name: ROOT / path for name, path in cfg["package-dir"].items()}
    found = set()
    for name, path in dirs.items():
        for init in path.rglob("__init__.py"):
            rel = init.parent.relative_to(path)
            found.add(".".join([name, *rel.parts]))
    assert found == listed, (
        f"pyproject packages differ from the tree: missing {found - listed}, stale {listed - found}"
    )


def test_console_script_is_declared() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["project"]["scripts"]["sbpflow"] == "sbpflow.client.cli.main:main"
