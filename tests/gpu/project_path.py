"""This checkout importable as ``sbpflow`` with no install step (the GPU machine runs it as it is).

pyproject.toml maps three top-level folders into the ``sbpflow`` namespace (``client/`` is
``sbpflow.client``, and so on); an install does that mapping, a bare checkout on ``PYTHONPATH`` does not.
Importing this module puts the checkout first on ``sys.path`` and a finder for those three packages first
on ``sys.meta_path``, before anything imports ``sbpflow``. Load it as a pytest plugin
(``python3 -m pytest -p tests.gpu.project_path ...``) or import it first in a script.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
# the [tool.setuptools.package-dir] entries but sbpflow's own (tests/gpu/test_project_path.py checks them)
FOLDERS = {
    "sbpflow.client": "client",
    "sbpflow.control_plane": "control_plane",
    "sbpflow.actor_workers": "actor_workers",
}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``sbpflow.client``, ``sbpflow.control_plane`` and ``sbpflow.actor_workers`` in their folders
    of this checkout (their subpackages then follow from each package's search location)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = FOLDERS.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
        )


def install() -> None:
    """Idempotent: the checkout first on sys.path, the finder first on sys.meta_path."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder())


install()
