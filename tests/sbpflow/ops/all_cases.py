"""Imports every family's case module so that CASES is complete."""

from __future__ import annotations

import importlib
import pkgutil

import tests.sbpflow.ops as pkg

_loaded = False


def load() -> None:
    global _loaded
    if _loaded:
        return
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("cases_"):
            importlib.import_module(f"tests.sbpflow.ops.{info.name}")
    _loaded = True
