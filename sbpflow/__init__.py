"""sbpflow: distributed training with SBP global tensors. ``import sbpflow as sf``.

    sf.placement("cpu", ranks=[0, 1])          # where a tensor lives
    sf.sbp.split(0), sf.sbp.broadcast, sf.sbp.partial_sum
    sf.nn, sf.nn.functional, sf.optim, sf.data, sf.Graph -> graph.trace(data) -> sf.Job
    sf.run(job) -> losses per step (and, on request, the trained parameters)

Importing stays light: numpy only (no Ray or gRPC until a job is submitted; ``sf.run`` loads the
compiler and the runtime on first use).
"""

import sys as _sys
from typing import Any as _Any

from sbpflow import data, random, sbp
from sbpflow.client import functional as _functional
from sbpflow.client import nn, optim
from sbpflow.client.context import TracingError
from sbpflow.client.static_graph import Graph, GraphConfig
from sbpflow.client.tensor import Tensor
from sbpflow.data import corpus
from sbpflow.dtype import DType, bfloat16, float16, float32, float64, int32, int64
from sbpflow.errors import GraphError, PlacementError, SbpError, SbpflowError, ShapeError
from sbpflow.job import Job, JobConfig
from sbpflow.placement import Placement, placement
from sbpflow.runs.options import RunOptions

bool_ = DType.bool

# ``import sbpflow.nn.functional as F`` and ``from sbpflow.optim import AdamW`` work as in OneFlow/PyTorch:
# the user-facing names are aliases of the client package's modules.
_sys.modules.setdefault(f"{__name__}.nn", nn)
_sys.modules.setdefault(f"{__name__}.nn.functional", _functional)
_sys.modules.setdefault(f"{__name__}.nn.parallel", nn.parallel)
_sys.modules.setdefault(f"{__name__}.optim", optim)

__version__ = "0.1.0"


# Loaded on first use, not at ``import sbpflow`` (the runtime, the compiler, Ray, gRPC): name -> module.
_LAZY = {
    "run": "sbpflow.control_plane.launch.launcher",
    "RunCancelled": "sbpflow.actor_workers.runtime.errors",
    "Client": "sbpflow.client.client",
}


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
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
