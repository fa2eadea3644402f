"""Small tracing helpers for the client tests: a Graph made from a function and in-memory data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import sbpflow as sf
from sbpflow.data.sources import ArraySource


def arrays(batch: int = 4, **shapes: Any) -> ArraySource:
    """An ArraySource with one field per keyword: ``x=((8,), "float32")`` -> x [batch, 8] float32."""
    rng = np.random.default_rng(0)
    out = {}
    for name, (shape, dtype) in shapes.items():
        if np.dtype(dtype).kind == "f":
            out[name] = rng.standard_normal((batch, *shape)).astype(dtype)
        else:
            out[name] = rng.integers(0, 8, size=(batch, *shape)).astype(dtype)
    return ArraySource(batch_size=batch, arrays=out)


def trace(
    build: Callable[..., Any],
    data: ArraySource,
    modules: dict[str, sf.nn.Module] | None = None,
    **trace_kwargs: Any,
) -> sf.Job:
    """Trace ``build(graph, *inputs)`` (inputs in the source's field order) with ``modules`` attached."""

    class FnGraph(sf.Graph):
        def __init__(self) -> None:
            super().__init__()
            for k, v in (modules or {}).items():
                setattr(self, k, v)

        def build(self, *inputs: Any) -> Any:
            return build(self, *inputs)

    return FnGraph().trace(data, **trace_kwargs)
