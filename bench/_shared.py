"""What several benchmarks share: loading an example file as a module, naming numpy's BLAS core, the
arguments of a script that repeats a timed run."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (the examples are files, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def blas_kernel() -> str:
    """numpy's OpenBLAS core (threadpoolctl): OPENBLAS_CORETYPE picks an older one."""
    import numpy
    from threadpoolctl import threadpool_info

    numpy.ones((2, 2)) @ numpy.ones((2, 2))  # numpy's BLAS is loaded
    return ", ".join(
        f"{i.get('internal_api')} {i.get('architecture')} x{i.get('num_threads')}"
        for i in threadpool_info()
        if i.get("user_api") == "blas"
    )


def repeat_args(doc: str, steps: int = 12, repeat: int = 3) -> argparse.Namespace:
    """The arguments of a script that times ``--steps`` steps ``--repeat`` times, with a ``--quick`` smoke run."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--repeat", type=int, default=repeat)
    return ap.parse_args()
