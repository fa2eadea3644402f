"""sbpflow: distributed training with SBP global tensors. ``import sbpflow as sf``.

    sf.placement("cpu", ranks=[0, 1])          # where a tensor lives
    sf.sbp.split(0), sf.sbp.broadcast, sf.sbp.partial_sum
    sf.nn, sf.nn.functional, sf.optim, sf.data, sf.Graph -> graph.trace(data) -> sf.Job
    sf.run(job) -> losses per step (and, on request, the trained parameters)

Importing stays light: every name here is loaded on first use (:data:`_NAMES`), the front end on the first
``sf.nn``, the compiler and the runtime on the first ``sf.run``. So a worker that imports a core module
(``import sbpflow.sharding`` runs this file first) loads no client module (``tests/client/test_facade.py``
checks it). ``import sbpflow.nn.functional as F`` and ``from sbpflow.optim import AdamW`` work as in
OneFlow and PyTorch: those import paths are aliases of the client's modules (:data:`_ALIASES`), resolved
when they are imported.
"""

import importlib as _importlib
import importlib.abc as _abc
import importlib.machinery as _machinery
import sys as _sys
from types import ModuleType as _ModuleType
from typing import TYPE_CHECKING
from typing import Any as _Any

# Bound now: ``sbpflow.placement`` is also a core module, and importing it (as most of the core does) makes
# it this package's attribute unless the function is bound here first. It loads only the core's errors.
from sbpflow.placement import Placement, placement

__version__ = "0.1.0"

# name -> (module, attribute path in it; "" for the module itself), loaded on first use.
_NAMES: dict[str, tuple[str, str]] = {
    "sbp": ("sbpflow.sbp", ""),
    "random": ("sbpflow.random", ""),
    "data": ("sbpflow.data", ""),
    "corpus": ("sbpflow.data.corpus", ""),
    "nn": ("sbpflow.client.nn", ""),
    "optim": ("sbpflow.client.optim", ""),
    "Graph": ("sbpflow.client.static_graph", "Graph"),
    "GraphConfig": ("sbpflow.client.static_graph", "GraphConfig"),
    "Tensor": ("sbpflow.client.tensor", "Tensor"),
    "TracingError": ("sbpflow.client.context", "TracingError"),
    "Client": ("sbpflow.client.client", "Client"),
    "Job": ("sbpflow.job", "Job"),
    "JobConfig": ("sbpflow.job", "JobConfig"),
    "RunOptions": ("sbpflow.runs.options", "RunOptions"),
    "run": ("sbpflow.control_plane.launch.launcher", "run"),
    "RunRequest": ("sbpflow.control_plane.launch.run_context", "RunRequest"),
    "RunCancelled": ("sbpflow.actor_workers.runtime.errors", "RunCancelled"),
    **{
        n: ("sbpflow.errors", n)
        for n in ("GraphError", "PlacementError", "SbpError", "SbpflowError", "ShapeError")
    },
    **{
        n: ("sbpflow.dtype", n)
        for n in ("DType", "bfloat16", "float16", "float32", "float64", "int32", "int64")
    },
    "bool_": ("sbpflow.dtype", "DType.bool"),
}

# The OneFlow/PyTorch-style import paths: alias -> the client module it is.
_ALIASES: dict[str, str] = {
    f"{__name__}.nn": "sbpflow.client.nn",
    f"{__name__}.nn.functional": "sbpflow.client.functional",
    f"{__name__}.nn.parallel": "sbpflow.client.nn.parallel",
    f"{__name__}.optim": "sbpflow.client.optim",
}


def __getattr__(name: str) -> _Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, path = _NAMES[name]
    value: _Any = _importlib.import_module(module)
    for part in path.split(".") if path else ():
        value = getattr(value, part)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES})


class _AliasFinder(_abc.MetaPathFinder, _abc.Loader):
    """Imports an alias of :data:`_ALIASES` as the module it names (the same module object)."""

    def __init__(self) -> None:
        self._specs: dict[str, _Any] = {}  # alias -> the module's own spec, which the import replaces

    def find_spec(
        self, fullname: str, path: _Any = None, target: _Any = None
    ) -> _machinery.ModuleSpec | None:
        return _machinery.ModuleSpec(fullname, self) if fullname in _ALIASES else None

    def create_module(self, spec: _machinery.ModuleSpec) -> _ModuleType:
        module = _importlib.import_module(_ALIASES[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: _ModuleType) -> None:
        """Nothing to run (the module ran when it was imported); its own spec back."""
        module.__spec__ = self._specs.pop(module.__spec__.name)  # type: ignore[union-attr]


if not any(isinstance(f, _AliasFinder) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _AliasFinder())

if TYPE_CHECKING:  # what type checkers see of the names above (nothing is imported at run time)
    from sbpflow import data, random, sbp
    from sbpflow.actor_workers.runtime.errors import RunCancelled  # noqa: F401
    from sbpflow.client import nn, optim
    from sbpflow.client.client import Client  # noqa: F401
    from sbpflow.client.context import TracingError
    from sbpflow.client.static_graph import Graph, GraphConfig
    from sbpflow.client.tensor import Tensor
    from sbpflow.control_plane.launch.launcher import run  # noqa: F401
    from sbpflow.control_plane.launch.run_context import RunRequest  # noqa: F401
    from sbpflow.data import corpus
    from sbpflow.dtype import DType, bfloat16, float16, float32, float64, int32, int64
    from sbpflow.errors import GraphError, PlacementError, SbpError, SbpflowError, ShapeError
    from sbpflow.job import Job, JobConfig
    from sbpflow.runs.options import RunOptions

    bool_ = DType.bool

__all__ = [  # the names of ``from sbpflow import *``: every name above but the heavy ones (Client, run,
    # RunRequest, RunCancelled); tests/client/test_facade.py checks the list against _NAMES
    "DType",
    "Graph",
    "GraphConfig",
    "GraphError",
    "Job",
    "JobConfig",
    "Placement",
    "PlacementError",
    "RunOptions",
    "SbpError",
    "SbpflowError",
    "ShapeError",
    "Tensor",
    "TracingError",
    "bfloat16",
    "bool_",
    "corpus",
    "data",
    "float16",
    "float32",
    "float64",
    "int32",
    "int64",
    "nn",
    "optim",
    "placement",
    "random",
    "sbp",
]
