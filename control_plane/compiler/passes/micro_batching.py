"""Pass 8, micro-batching: gradient accumulation and pipeline stages.

A step's batch is cut into ``M = gradient_accumulation_steps x micro_batches`` micro-batches along axis 0
(the reference executor's convention, :func:`sbpflow.oracle.reference.micro_batches`). ``run(state)``:

* **validates the stages** of the user's forward graph (``OpNode.stage``, set by ``Module.set_stage``;
  backward ops inherit their forward op's): numbered ``0 .. S-1`` without gaps, data flowing forward only
  (a reader in an earlier stage than its producer is refused, naming both ops, their stages and the fix),
  and ``M >= S`` under 1F1B;
* **makes the compiled graph the per-micro-batch graph**: every tensor's meta and every op's attrs become
  those of :func:`sbpflow.oracle.reference.micro_batch_job` traced through the same graph passes (so a backward
  ``sum_to``/``reshape`` gets exactly the shapes the reference runs, with no guessing which dims are the
  batch), and every boxing node is re-planned for its new shape. Placements and SBPs are unchanged.

:func:`layout` then tells lowering what runs when (:class:`Layout`): ops that read only parameters run once
per step before the micro-batches (``pre``); ops that depend on the data run once per micro-batch in
their (stage, F|B) action of the :mod:`schedule`; each gradient is averaged over the micro-batches by
ACCUMULATE tasks — at the last point before any boxing, so a data-parallel all-reduce runs once per step,
not once per micro-batch (boxing is linear, so the mean commutes with it) — and the ops that read the
averages (clipping, the update) run once per step after them (``step``). The loss is averaged the same way.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from sbpflow.boxing import plan_boxing
from sbpflow.control_plane.compiler.passes.autodiff import is_backward
from sbpflow.control_plane.compiler.passes.optimizer import PREFIX as OPTIMIZER
from sbpflow.control_plane.compiler.passes.rewrites import rewritten
from sbpflow.control_plane.compiler.schedule import Phase, Schedule, build
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import GraphError, ShapeError
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import Job, PipelineSchedule
from sbpflow.ops.base import get_op
from sbpflow.oracle.reference import micro_batch_job, micro_batches
from sbpflow.sbp import Split

PACKAGE = "sbpflow.control_plane.compiler"
Slot = tuple[int, Phase]  # (stage, phase): where a per-micro-batch op runs


class PipelineError(GraphError):
    """The stages or the micro-batch count cannot form a pipeline."""


def run(state: CompileState) -> None:
    job = state.job
    m = micro_batches(job)
    stages = check_stages(job.graph)
    kind = job.config.pipeline_schedule
    if kind is PipelineSchedule.one_f_one_b and m < stages:
        raise PipelineError(
            f"job {job.name!r}: a 1F1B pipeline of {stages} stages needs at least {stages} micro-batches per "
            f"step, but it has {m} (gradient_accumulation_steps={job.config.gradient_accumulation_steps} x "
            f"micro_batches={job.config.micro_batches}); set micro_batches >= {stages}, use fewer stages, or "
            "pipeline_schedule='gpipe'"
        )
    if m > 1:
        _check_rows(state.graph, job, m)
        _cut(state, m)


# ---- validation ---------------------------------------------------------------------------------------


def check_stages(g: Graph) -> int:
    """The number of stages of the forward graph ``g``; raise :class:`PipelineError` when they are
    not ``0 .. S-1`` or when data flows from a later stage to an earlier one."""
    producer = {o: node for node in g.ops for o in node.outputs}
    used = sorted({o.stage for o in g.ops})
    if used and used[0] < 0:
        example = next(o for o in g.ops if o.stage == used[0])
        raise PipelineError(
            f"op {example.name!r} is in stage {example.stage}; pipeline stages are numbered from 0: "
            "renumber the set_stage() calls"
        )
    if used and used != list(range(len(used))):
        # the first gap, without enumerating up to the largest stage (a user's number, maybe 2**31-1)
        first = next((i for i, s in enumerate(used) if s != i), len(used))
        example = next(o for o in g.ops if o.stage > first)
        raise PipelineError(
            f"pipeline stages must be numbered 0 .. S-1 without gaps, but the ops use stages {used} (no op is in "
            f"stage {first}; op {example.name!r} is in stage {example.stage}); renumber the set_stage() calls"
        )
    flows = {(producer[i].stage, o.stage) for o in g.ops for i in o.inputs if i in producer}
    for node in g.ops:
        for i in node.inputs:
            p = producer.get(i)
            if p is None or p.stage <= node.stage:
                continue
            cycle = (
                f" — together with data flowing from stage {node.stage} to stage {p.stage} this is a cycle "
                "between stages"
                if (node.stage, p.stage) in flows
                else ""
            )
            raise PipelineError(
                f"stages out of order: op {node.name!r} ({node.op_type}) in stage {node.stage} reads {i!r}, "
                f"which op {p.name!r} ({p.op_type}) computes in the later stage {p.stage}{cycle}; data must flow "
                f"from each stage to the same or a later one: move {node.name!r} to stage >= {p.stage} or "
                f"{p.name!r} to stage <= {node.stage} (set_stage on their modules)"
            )
    return max(1, len(used))


def _check_rows(g: Graph, job: Job, m: int) -> None:
    """Each rank that splits the batch must keep at least one row of every micro-batch."""
    for t in g.of_kind(TensorKind.input):
        if not t.meta.ndim or t.placement is None or t.sbp is None:
            continue
        ways = 1
        for size, s in zip(t.placement.shape, t.sbp, strict=True):
            ways *= size if isinstance(s, Split) and s.axis == 0 else 1
        rows = t.meta.shape[0] // m
        if rows < ways:
            raise PipelineError(
                f"input {t!r}: its batch of {t.meta.shape[0]} cut into {m} micro-batches leaves {rows} rows per "
                f"micro-batch for the {ways} ranks that split it; use a batch of at least {m * ways} or fewer "
                "micro-batches"
            )


# ---- the per-micro-batch graph ------------------------------------------------------------------------


def _cut(state: CompileState, m: int) -> None:
    """Give every tensor and op of ``state.graph`` its per-micro-batch meta and attrs."""
    twin = _graph_passes(micro_batch_job(state.job, m))
    g = state.graph
    for t in g.of_kind(TensorKind.input):
        g.tensors[t.name] = dataclasses.replace(t, meta=twin.tensors[t.name].meta)
    for i, node in enumerate(g.ops):
        if node.op_type == BOXING:  # logically the identity; re-planned for the new shape
            src, dst = g.tensors[node.inputs[0]], g.tensors[node.outputs[0]]
            assert src.placement and src.sbp is not None and dst.placement and dst.sbp is not None
            g.tensors[dst.name] = dataclasses.replace(dst, meta=src.meta)
            plan = plan_boxing(src.meta, src.placement, src.sbp, dst.placement, dst.sbp)
            state.boxings[node.name] = plan
            g.ops[i] = dataclasses.replace(node, attrs={**node.attrs, "plan": repr(plan)})
            continue
        same = twin.ops.get(node.name)
        attrs = dict(same.attrs) if same is not None else dict(node.attrs)
        op = get_op(node.op_type)
        try:
            metas = op.run_infer(tuple(g.tensors[x].meta for x in node.inputs), op.normalize_attrs(attrs))
        except ShapeError as e:
            raise GraphError(
                f"op {node.name!r} ({node.op_type}) cannot run on a micro-batch ({m} per step): {e}"
            ) from None
        for name, meta in zip(node.outputs, metas, strict=True):
            g.tensors[name] = dataclasses.replace(g.tensors[name], meta=meta)
        if attrs != dict(node.attrs):
            g.ops[i] = dataclasses.replace(node, attrs=attrs)


@dataclass(frozen=True)
class _Twin:
    """The micro-batch job after the graph passes: its tensors and ops by name."""

    tensors: Mapping[str, TensorDecl]
    ops: Mapping[str, OpNode]


def _graph_passes(job: Job) -> _Twin:
    """``job`` through the passes that run before SBP inference, names matching the compiled graph's."""
    state = rewritten(job)
    return _Twin(state.graph.tensors, {o.name: o for o in state.graph.ops})


# ---- what runs when -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Lowering's timetable: ``pre`` ops once per step first, then per micro-batch the ops of each
    (stage, phase) slot in the order of ``schedule.timeline()``, then the ``step`` ops. ``accumulate``
    lists the tensors averaged over the micro-batches (gradients, the loss) at the end of their slot."""

    micro_batches: int
    schedule: Schedule
    pre: tuple[str, ...]
    slots: Mapping[Slot, tuple[str, ...]]
    step: tuple[str, ...]
    accumulate: tuple[str, ...]
    slot_of: Mapping[str, Slot]


def layout(state: CompileState) -> Layout:
    g, job = state.graph, state.job
    m = micro_batches(job)
    stages = 1 + max((o.stage for o in g.ops), default=0)
    sched = build(job.config.pipeline_schedule, stages, m)
    producer = {o: node for node in g.ops for o in node.outputs}
    data = {t.name for t in g.of_kind(TensorKind.input)}
    for node in g.ops:  # the closure of what depends on the batch
        if any(i in data for i in node.inputs):
            data.update(node.outputs)
    reads = Counter(i for o in g.ops for i in o.inputs)
    acc = {
        _accumulation_point(producer, reads, t, data) for t in (*state.grads.values(), job.loss) if t in data
    }
    late: set[str] = set(acc)
    step = []
    for node in g.ops:
        if any(i in late for i in node.inputs):
            late.update(node.outputs)
            step.append(node.name)
    later = set(step)
    pre = [o.name for o in g.ops if o.name not in later and not any(x in data for x in o.outputs)]
    per_mb = [o for o in g.ops if o.name not in later and any(x in data for x in o.outputs)]
    slot_of = _slots(per_mb, producer, _after_forward(g))
    _check_flow(g, per_mb, producer, slot_of, stages, set(step), data - late)
    slots: dict[Slot, list[str]] = {}
    for o in _batch_only_first(g, per_mb):
        slots.setdefault(slot_of[o.name], []).append(o.name)
    return Layout(
        m,
        sched,
        tuple(pre),
        {k: tuple(v) for k, v in slots.items()},
        tuple(step),
        tuple(sorted(acc)),
        slot_of,
    )


def _batch_only_first(g: Graph, ops: list[OpNode]) -> list[OpNode]:
    """``ops`` with those that read nothing but the batch (and what only the batch makes) moved first, in
    their order: a loss's token count (``sum(targets != ignore)``) and its all-reduce then run as soon as
    the batch is loaded, beside the forward, instead of between forward and backward, where every rank
    would wait for the slowest one's forward before its backward (the 1/N the backward needs). The plan's
    order is the actors' priority, and a topological order with them first is still one."""
    free = {t.name for t in g.of_kind(TensorKind.input)}
    first = []
    for o in ops:
        if all(i in free for i in o.inputs):
            free.update(o.outputs)
            first.append(o)
    moved = {o.name for o in first}
    return [*first, *(o for o in ops if o.name not in moved)]


def _after_forward(g: Graph) -> set[str]:
    """Ops from the first one autodiff or the optimizer emitted on: the backward (with what the
    checkpointing pass recomputes there). Boxing nodes are placed by :func:`_slots`."""
    end = next((i for i, o in enumerate(g.ops) if is_backward(o) or o.name.startswith(OPTIMIZER)), len(g.ops))
    return {o.name for o in g.ops[end:]}


# what an accumulation may move before: linear, and elementwise the same arithmetic on each element (a
# bucket's unpack: one average of its packed array instead of one per gradient, then one all-reduce)
_THROUGH = (BOXING, "unpack")


def _accumulation_point(producer: Mapping[str, OpNode], reads: Counter[str], t: str, data: set[str]) -> str:
    """Where to average ``t``: before the boxing chain (a gradient bucket's included) that produces it,
    when that chain is only its (a bucket's packed array is its gradients')."""
    while (p := producer.get(t)) is not None and p.op_type in _THROUGH:
        src = p.inputs[0]
        if src not in data or reads[src] != 1:
            break
        t = src
    return t


def _slots(ops: list[OpNode], producer: Mapping[str, OpNode], backward: set[str]) -> dict[str, Slot]:
    """(stage, phase) of each per-micro-batch op. A boxing runs with the op that made its input (a send
    leaves as soon as its value exists; a data input's boxing in stage 0's forward), except that a forward
    value only backward ops read is boxed in the backward of its readers' stage (it is not kept twice)."""
    slot: dict[str, Slot] = {}
    for o in ops:
        if o.op_type != BOXING:
            slot[o.name] = (o.stage, Phase.B if o.name in backward else Phase.F)
        else:
            p = producer.get(o.inputs[0])
            slot[o.name] = slot[p.name] if p is not None and p.name in slot else (0, Phase.F)
    readers: dict[str, list[str]] = {}
    for o in ops:
        for i in o.inputs:
            readers.setdefault(i, []).append(o.name)
    for o in reversed(ops):
        mine = readers.get(o.outputs[0], [])
        if o.op_type == BOXING and mine and all(slot[r][1] is Phase.B for r in mine):
            slot[o.name] = (o.stage, Phase.B) if slot[o.name][1] is Phase.F else slot[o.name]
    return slot


def _order(slot: Slot, stages: int) -> tuple[int, int]:
    """Position of a slot within one micro-batch: forwards by stage, then backwards in reverse."""
    stage, phase = slot
    return (0, stage) if phase is Phase.F else (1, stages - 1 - stage)


def _check_flow(
    g: Graph,
    ops: list[OpNode],
    producer: Mapping[str, OpNode],
    slot: Mapping[str, Slot],
    stages: int,
    late_ops: set[str],
    per_mb_tensors: set[str],
) -> None:
    for o in ops:
        for i in o.inputs:
            p = producer.get(i)
            if p is None or p.name not in slot:
                continue
            if _order(slot[p.name], stages) > _order(slot[o.name], stages):
                (ps, pph), (os_, oph) = slot[p.name], slot[o.name]
                raise PipelineError(
                    f"stages out of order: op {o.name!r} ({o.op_type}, stage {os_} {oph.value}) reads {i!r}, "
                    f"which op {p.name!r} ({p.op_type}, stage {ps} {pph.value}) computes later in each "
                    "micro-batch; data must flow forward through the stages and back: fix the stages of the ops"
                )
    for o in g.ops:
        if o.name in late_ops:
            bad = [i for i in o.inputs if i in per_mb_tensors]
            if bad:
                raise PipelineError(
                    f"op {o.name!r} ({o.op_type}) runs once per step on averaged gradients but also reads "
                    f"{bad}, which differ per micro-batch; only gradients and the loss are averaged over "
                    "micro-batches"
                )
