"""Imports every family's case module (``cases_*``, in this package and its subpackages) so that CASES is
complete."""

from __future__ import annotations

import importlib
import pkgutil

import tests.sbpflow.ops as pkg

_loaded = False


def load() -> None:
    global _loaded
    if _loaded:
        return
    for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
        if info.name.rsplit(".", 1)[-1].startswith("cases_"):
            importlib.import_module(info.name)
    _loaded = True
