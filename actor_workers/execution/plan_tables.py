"""What the runtime reads off a Plan besides its tasks: the plan's tables, decoded once per build.

Lowering writes, as plain data beside the DevicePlans, everything the acts need that is not per task:
the compiled graph's tensors with their placements and nd-SBPs (the shard each rank holds, the metas a
kernel runs on), the variables' initialisers, the data source, the config (the seed), the loss and
fetch names, and the number of micro-batches. The runtime reads these and never ``Plan.job``, which the
plan keeps for dumps and reference only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sbpflow.codec import wire
from sbpflow.data.sources import DataSource, with_roots
from sbpflow.graph import TensorDecl
from sbpflow.job import JobConfig, ParameterSpec
from sbpflow.v1 import plan_pb2 as pp


@dataclass(frozen=True)
class PlanTables:
    """The plan's tables as values (module docstring)."""

    name: str
    tensors: Mapping[str, TensorDecl]  # the compiled (per-micro-batch) graph's tensors, by name
    parameters: Mapping[str, ParameterSpec]  # variable -> its initialiser
    data: DataSource | None
    config: JobConfig
    loss: str
    fetches: tuple[str, ...]
    micro_batches: int


def of(
    plan: pp.Plan, data_roots: tuple[str, ...] | None = None, data: DataSource | None = None
) -> PlanTables:
    """The tables of ``plan``, decoded (a plan from before they existed has none: recompile it);
    ``data_roots`` (``RunOptions.data_roots``, the control plane's): the folders the data source's files
    must be in, checked on each file as opened (:mod:`sbpflow.data.access`). ``data``: the source the
    plan's was written from, in the same process (an in-process run's job's): read as it is, so that an
    in-memory source's arrays are not decoded into one more copy."""
    if plan.HasField("data"):
        data = with_roots(wire.data_from_proto(plan.data) if data is None else data, data_roots)
    else:
        data = None
    tensors = {t.name: wire.tensor_from_proto(t) for t in plan.tensors}
    return PlanTables(
        name=plan.job_name,
        tensors=tensors,
        parameters={
            p.tensor: ParameterSpec(p.tensor, wire.initializer_from_proto(p.init), p.trainable)
            for p in plan.parameters
        },
        data=data,
        config=wire.config_from_proto(plan.config),
        loss=plan.loss,
        fetches=tuple(plan.fetches),
        micro_batches=max(plan.micro_batches, 1),
    )
