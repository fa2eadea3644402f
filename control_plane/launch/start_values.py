"""Where a run's parameters start: ``init_from=`` checked against the job, in sbpflow's layout or
another (``layout="torch"``), or the values the job's modules held when it was traced.

``init_from`` is strict by default: a file that lacks a parameter of the job, holds one the job does
not have, or holds one in another shape or dtype is refused with every problem named
(:mod:`sbpflow.checkpoint.imports`); ``strict=False`` imports what matches by name (cast to the job's
dtype) and leaves the rest to the initializers. A file in another layout, or the modules' values, go
to the ranks as a temporary safetensors file of logical tensors under the job's names.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from sbpflow.checkpoint.format import CheckpointError, write_safetensors
from sbpflow.checkpoint.imports import check, metas_of
from sbpflow.checkpoint.read import open_tensors
from sbpflow.job import Job

FIX = "export the parameters of this job's model, or pass layout='torch' for a PyTorch state dict"


def wanted(job: Job) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every parameter of ``job`` with its shape and dtype."""
    metas = {p.tensor: job.graph.tensors[p.tensor].meta for p in job.parameters}
    return {n: (m.shape, m.dtype.to_numpy()) for n, m in metas.items()}


def converted(job: Job, init_from: str, layout: str) -> dict[str, np.ndarray]:
    """The parameters of ``init_from`` (a file in ``layout``) under the job's names and layout."""
    if job.bound is None:
        raise CheckpointError(
            f"init_from with layout={layout!r} needs the job's modules to map names and layouts: trace the "
            "job in this process (sf.Graph.trace), or convert the file first (sbpflow export --layout)"
        )
    reader = open_tensors(init_from)
    return job.bound.from_layout(layout, {n: reader.read(n) for n in metas_of(reader)})


@contextmanager
def start_file(
    job: Job, init_from: str | None, layout: str | None = None, strict: bool = True
) -> Iterator[str | None]:
    """The file the run's ranks import parameters from (None: their initializers), checked."""
    if init_from is None:
        held = job.bound.held() if job.bound is not None else {}
        with _written(held) as path:
            yield path
        return
    tensors = converted(job, init_from, layout) if layout else None
    given = {n: (a.shape, a.dtype) for n, a in tensors.items()} if tensors is not None else None
    if given is None:
        given = metas_of(open_tensors(init_from))
    fix = (
        FIX
        if layout is None
        else f"give a file in layout {layout!r} (model.state_dict(layout={layout!r}) names)"
    )
    check(wanted(job), given, strict, f"init_from={init_from}", fix)
    if tensors is None:
        yield init_from
        return
    with _written(tensors) as path:
        yield path


@contextmanager
def _written(tensors: Mapping[str, np.ndarray]) -> Iterator[str | None]:
    """``tensors`` as a temporary safetensors file, removed afterwards (None: no tensors)."""
    if not tensors:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="sbpflow-start-") as d:
        path = Path(d) / "parameters.safetensors"
        write_safetensors(path, {n: np.ascontiguousarray(a) for n, a in tensors.items()})
        yield str(path)
