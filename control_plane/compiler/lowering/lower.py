"""Lowering: the compiled logical graph becomes the physical Plan — per rank, tasks and their registers.

Input contract (the state after boxing): every tensor has a placement and an nd-SBP, every op reads its
inputs on its own placement with the SBP its signature needs, and each BOXING node has its plan in
``state.boxings`` (planned here when missing). One task (one actor) per (op, rank):

    what                           task          stream          registers written
    parameter / optimizer state    SOURCE        compute         its local shard, 1 buffer
    input (data source)            DATA_LOAD     data            its local shard, 2 buffers (prefetch)
    op of the library              KERNEL        compute         one per output, 1 buffer
    update op (OPTIMIZER_OPS)      OPTIMIZER     compute         one per output, 1 buffer
    boxing step (collective)       BOXING        communication   the shard after the step
    boxing across placements       SEND / RECV   communication   the received piece (on the receiver)
    update (state.updates)         SINK assign   compute         —   (writes the persistent store; the
                                                                     executor folds it into its value's
                                                                     producer: folded_assigns)
    loss, fetches                  SINK fetch    compute         —   (reports the value)


The walk (:func:`lower`) visits the graph in one global order — the sources, the ops run once before
the micro-batches, each micro-batch's ops in the schedule's order, the ops run once after, the updates,
the fetches — and every rank's tasks and every communicator's calls follow it. Its parts:

    lowering_tasks      the id counters, tasks and registers of sources, kernels, accumulations, sinks
    lowering_boxing     boxing steps: collectives, send/recv between placements, the communicator order
    lowering_on_demand  one rank's DevicePlan without the others' tasks; the order check without them

"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from sbpflow.boxing import BoxingPlan
from sbpflow.codec import wire
from sbpflow.control_plane.compiler.lowering.boxing import Lowerer, Memo
from sbpflow.control_plane.compiler.lowering.tasks import SOURCE_KINDS, K, LoweringError
from sbpflow.control_plane.compiler.passes import micro_batching
from sbpflow.control_plane.compiler.passes.micro_batching import Layout
from sbpflow.control_plane.compiler.schedule import Phase
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import Graph, OpNode, TensorKind
from sbpflow.limits import CompileBudget
from sbpflow.oracle.reference import micro_batches
from sbpflow.placement import Placement
from sbpflow.v1 import plan_pb2 as pp

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Lowered:
    """One walk of the lowering: the DevicePlans of the ranks asked for, with ids and communicator
    positions equal to those of the full plan, and the totals over every rank (built or not)."""

    devices: dict[int, pp.DevicePlan]
    communicators: list[pp.Communicator]  # those the built ranks are members of; only their steps
    tasks: int
    registers: int
    trail: list[tuple[str, BoxingPlan, int]] | None  # (boxing op, plan, step) in the global order, if asked


def run(state: CompileState, job_id: str = "", budget: CompileBudget | None = None) -> pp.Plan:
    """The physical plan of ``state.graph``, every rank's tasks; ``state`` is not changed."""
    return to_plan(state, lower(state, budget=budget), job_id)


def to_plan(state: CompileState, low: Lowered, job_id: str = "") -> pp.Plan:
    plan = plan_header(state, job_id)
    plan.devices.extend(low.devices[r] for r in sorted(low.devices))
    plan.communicators.extend(low.communicators)
    return plan


def plan_header(state: CompileState, job_id: str = "") -> pp.Plan:
    """A Plan without devices and communicators: the compiled job (for dumps and reference) and, as
    plain data, everything the runtime reads instead of it — the tensors with their layouts, the
    initialisers, the data source, the config, the loss and fetches, the number of micro-batches.

    The job's data source is ``Plan.data`` alone, not ``Plan.job.data`` too: an in-memory source's arrays
    are in it, once."""
    job = wire.job_to_proto(dataclasses.replace(state.job, graph=state.graph, data=None))
    plan = pp.Plan(
        format_version=PLAN_FORMAT_VERSION,
        job_id=job_id,
        job=job,
        tensors=job.graph.tensors,
        parameters=job.parameters,
        config=job.config,
        loss=job.loss,
        fetches=job.fetches,
        micro_batches=micro_batches(state.job),
        job_name=job.name,
    )
    if state.job.data is not None:
        plan.data.CopyFrom(wire.data_to_proto(state.job.data))
    return plan


def lower(
    state: CompileState,
    ranks: Iterable[int] | None = None,
    log: bool = False,
    memo: Memo | None = None,
    budget: CompileBudget | None = None,
) -> Lowered:
    """Walk the graph in the one global order and build the tasks of ``ranks`` (default: all).

    The walk visits every (op, micro-batch) of every rank, but an emission whose placement holds none of
    ``ranks`` only advances the id counters (by its placement's size), so one rank of a 1024-device job
    costs its own tasks plus a few microseconds per emission: its DevicePlan is the full plan's, id for id,
    without the other ranks' tasks. ``log=True`` also records every communicator call of every rank in
    order (what :func:`comm_order.check_calls` proves deadlock-free without the tasks). ``memo``: what an
    earlier walk of ``state`` worked out that does not depend on ``ranks`` (:class:`~.boxing.Memo`).
    ``budget``: counts this walk's steps, tasks and registers against its limits and stops the walk
    (``CompileLimitError``, ``CompileCancelled``) past one, at its deadline or once cancelled.
    """
    g = state.graph
    _require_layout(g)
    lay = micro_batching.layout(state)
    devices = _devices(g)
    keep = None if ranks is None else frozenset(ranks)
    if keep is not None:
        if keep - devices.keys():
            raise LoweringError(f"rank(s) {sorted(keep - devices.keys())} hold no tensor of this job")
        devices = {r: d for r, d in devices.items() if r in keep}
    if budget is not None:
        budget.walk()
    low = Lowerer(g, devices, keep, trail=[] if log else None, memo=memo or Memo(), budget=budget)
    ops = {o.name: o for o in g.ops}
    for decl in g.tensors.values():
        if decl.kind in SOURCE_KINDS:
            low.emit_source(decl, K.TASK_KIND_SOURCE)
    for name in lay.pre:
        low.emit_op(ops[name], state)
    fetches = list(dict.fromkeys(n for n in (state.job.loss, *state.job.fetches) if n))
    per_mb = {o for name in lay.slot_of for o in ops[name].outputs} | {
        t.name for t in g.of_kind(TensorKind.input)
    }
    _micro_batches(state, lay, low, ops, {n for n in fetches if n in per_mb})
    for name in lay.step:
        low.emit_op(ops[name], state)
    for var, new in state.updates.items():
        low.emit_assign(var, new)
    for name in fetches:
        if name not in per_mb or name in lay.accumulate:
            low.emit_fetch(name)
    built = {r: low.devices[r] for r in sorted(low.devices)}
    return Lowered(built, low.comm.to_proto(), low.next_task, low.next_reg, low.trail)


def _micro_batches(
    state: CompileState, lay: Layout, low: Lowerer, ops: dict[str, OpNode], fetched: set[str]
) -> None:
    """The per-micro-batch tasks in the schedule's global order (every rank's tasks and every
    communicator's steps follow it, so both ends of each stage-to-stage channel agree by construction)."""
    inputs = state.graph.of_kind(TensorKind.input)
    m = lay.micro_batches
    for stage, action in lay.schedule.timeline():
        k = action.micro_batch
        low.micro_batch = k if m > 1 else -1  # one micro-batch: the plain per-step plan
        if (stage, action.phase) == (0, Phase.F):  # the loaders feed micro-batch k first
            for decl in inputs:
                low.emit_source(decl, K.TASK_KIND_DATA_LOAD)
                if decl.name in fetched:
                    low.emit_fetch(decl.name)
        for name in lay.slots.get((stage, action.phase), ()):
            op = ops[name]
            low.emit_op(op, state)
            for out in op.outputs:
                if out in lay.accumulate:
                    if m > 1:
                        low.emit_accumulate(out, k, m, op.stage)
                elif out in fetched:
                    low.emit_fetch(out)
    low.micro_batch = -1


def _require_layout(g: Graph) -> None:
    missing = [t.name for t in g.tensors.values() if t.placement is None or t.sbp is None]
    if missing:
        raise LoweringError(
            f"tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} have no placement or SBP; lowering "
            "needs the SBP inference and boxing passes first (or annotate every tensor)"
        )


def _devices(g: Graph) -> dict[int, pp.DevicePlan]:
    kinds: dict[int, str] = {}
    first: dict[Placement, str] = {}  # a distinct placement once (a big job has few, on many tensors)
    for t in g.tensors.values():
        assert t.placement is not None
        first.setdefault(t.placement, t.name)
    for pl, name in first.items():
        for r in pl.ranks:
            if kinds.setdefault(r, pl.device_type) != pl.device_type:
                raise LoweringError(
                    f"rank {r} is {kinds[r]} for one tensor and {pl.device_type} for {name!r}; "
                    "a rank is one device: use distinct ranks for cpu and cuda placements"
                )
    device = {d: wire.placement_to_proto(Placement(d, (0,), (1,))).device_type for d in set(kinds.values())}
    return {r: pp.DevicePlan(rank=r, device_type=device[d]) for r, d in sorted(kinds.items())}
