"""The one-device reference executor: a Job's forward graph run op by op on whole numpy arrays.

It is the oracle for distributed equivalence: every parallel configuration of a job must reproduce its
losses. Parameters are drawn from their initializers keyed by (``config.seed``, ``tensor_rng_id(name)``)
— the same key the runtime uses for each shard, so the values agree whatever the layout — inputs are
batch ``step`` of the data source, and random ops draw with (seed, rng_id, step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow.errors import SbpflowError, ShapeError
from sbpflow.graph import TensorKind
from sbpflow.job import Job
from sbpflow.ops.eager import EagerBuilder
from sbpflow.random import RandomKey

Arrays = dict[str, Any]


def init_parameters(job: Job, xp: ModuleType = np) -> Arrays:
    """Every parameter's initial value, whole, by tensor name."""
    out: Arrays = {}
    for spec in job.parameters:
        meta = job.graph.tensors[spec.tensor].meta
        key = RandomKey.for_tensor(job.config.seed, spec.tensor)
        out[spec.tensor] = spec.init.sample(xp, key, meta.shape, None, meta.dtype.to_numpy())
    return out


def read_inputs(job: Job, step: int = 0) -> Arrays:
    """Batch ``step`` of the job's data source, one array per input tensor."""
    if job.data is None:
        raise SbpflowError(f"job {job.name!r} has no data source; pass inputs= explicitly")
    batch = job.data.read(step)
    return {t.name: batch[t.name] for t in job.graph.of_kind(TensorKind.input)}


def forward(
    job: Job,
    step: int = 0,
    fetches: Iterable[str] | None = None,
    parameters: Mapping[str, Any] | None = None,
    inputs: Mapping[str, Any] | None = None,
    xp: ModuleType = np,
) -> Arrays:
    """Run the forward graph of ``job`` for ``step``; returns the ``fetches`` (default: the loss and the
    job's fetches) by name. ``parameters``/``inputs`` override the initial values and the data batch."""
    g = job.graph
    values: Arrays = dict(init_parameters(job, xp))
    values.update(parameters or {})
    values.update(inputs if inputs is not None else read_inputs(job, step))
    _check_values(job, values)
    wanted = list(fetches) if fetches is not None else [n for n in (job.loss, *job.fetches) if n]
    unknown = [n for n in wanted if n not in g.tensors]
    if unknown:
        raise SbpflowError(f"fetch {unknown} names no tensor of job {job.name!r}")
    builder = EagerBuilder(xp, seed=job.config.seed, step=step)
    for node in g.ops:
        try:
            outs = builder.call(node.op_type, *(values[i] for i in node.inputs), **node.attrs)
        except ShapeError as e:
            raise ShapeError(f"op {node.name!r} ({node.op_type}): {e}") from None
        values.update(zip(node.outputs, outs, strict=True))
    return {n: values[n] for n in wanted}


def _check_values(job: Job, values: Arrays) -> None:
    """Every source tensor (parameter, input, constant) has a value of its declared shape and dtype."""
    for t in job.graph.tensors.values():
        if t.kind in (TensorKind.activation, TensorKind.gradient):
            continue
        if t.name not in values:
            raise SbpflowError(
                f"{t.kind.value} {t.name!r} {t.meta} has no value; pass it in parameters/inputs"
            )
        v = values[t.name]
        if tuple(v.shape) != t.meta.shape or v.dtype != t.meta.dtype.to_numpy():
            raise ShapeError(
                f"{t.kind.value} {t.name!r} is declared {t.meta} but its value is {list(v.shape)} {v.dtype}"
            )
