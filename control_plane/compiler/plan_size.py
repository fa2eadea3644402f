"""How big a job's physical plan will be, estimated before lowering builds any of it, and the refusal
of one over ``sbpflow.limits.Limits``.

Lowering makes one task per (op, rank, micro-batch): a job's plan grows with ops x micro-batches x
stages x ranks, numbers a user picks, and every task costs the control plane ~2 KB and ~50-100 us while
it is built (``bench/control_plane/hostile_compile.py``). So the compile is sized first, in two steps,
each linear in the job's graph and never in a number inside it:

* :func:`precheck`, before any graph pass: the pipeline's schedule (stages x micro-batches actions) and
  a floor under the plan's tasks and walk steps from the user's own ops;
* :func:`estimate` and :func:`check`, after the graph passes (Submit's compile, and again before a
  launch lowers): the walk's steps, every rank's tasks, the largest rank's tasks, registers and bytes.

A job over a limit is refused with :class:`~sbpflow.limits.CompileLimitError`, naming the quantity, its
value, the limit and what to change. What lowering then builds is counted against the same limits as
it goes (``CompileBudget``), so an estimate that falls short still stops the walk.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sbpflow.control_plane.compiler.lowering.tasks import SOURCE_KINDS, placement_of
from sbpflow.control_plane.compiler.passes import micro_batching
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, OpNode, TensorKind
from sbpflow.job import Job
from sbpflow.limits import LIMITS, Limits, over_budget
from sbpflow.oracle.reference import micro_batches
from sbpflow.placement import Placement

# serialised bytes of a task and of a register in a DevicePlan (GPT, measured: ~180 B for the pair)
TASK_BYTES, REGISTER_BYTES = 110, 80


@dataclass(frozen=True)
class PlanSize:
    """The plan a compiled job lowers to, estimated: ``walk_steps`` op emissions a lowering walk makes,
    ``tasks`` of every rank, and the largest rank's (``rank``) tasks, registers and serialised bytes."""

    walk_steps: int
    tasks: int
    rank: int
    rank_tasks: int
    rank_registers: int

    @property
    def plan_bytes(self) -> int:
        return self.rank_tasks * TASK_BYTES + self.rank_registers * REGISTER_BYTES


def precheck(job: Job, limits: Limits = LIMITS) -> None:
    """Before any pass: refuse a pipeline schedule or a plan that is over ``limits`` already from the
    user's ops (the compiled graph only adds ops: backward, optimizer, boxing)."""
    m = micro_batches(job)
    g = job.graph
    stages = 1 + max((o.stage for o in g.ops), default=0)
    head = f"job {job.name!r}: {stages} pipeline stage(s) x {m} micro-batches"
    _over("pipeline_slots", stages * m, limits.pipeline_slots, f"{head} = {stages * m:,} schedule slots")
    steps = len(g.ops) * m
    _over("walk_steps", steps, limits.walk_steps, f"job {job.name!r}: {len(g.ops)} ops x {m} micro-batches")

    def ranks(o: OpNode) -> int:  # before SBP inference, an op or its first output may have no placement
        pl = o.placement or (g.tensors[o.outputs[0]].placement if o.outputs else None)
        return pl.size if pl is not None else 1

    tasks = sum(ranks(o) for o in g.ops) * m
    _over(
        "plan_tasks",
        tasks,
        limits.plan_tasks,
        f"job {job.name!r}: at least {tasks:,} tasks (ops x ranks x {m})",
    )


def estimate(state: CompileState) -> PlanSize:
    """The plan's size from the compiled graph (after the graph passes), without lowering: lowering's
    walk counted per placement — an op once per micro-batch or once per step, a boxing once per step of
    its plan on its source and destination ranks, sources, data loads, accumulations and sinks."""
    g, lay = state.graph, micro_batching.layout(state)
    m = lay.micro_batches
    tasks: Counter[Placement] = Counter()
    regs: Counter[Placement] = Counter()
    steps = 0
    for o in g.ops:
        k = m if o.name in lay.slot_of else 1
        steps += k
        where = placement_of(g, o)
        if o.op_type == BOXING:
            plan = state.boxings.get(o.name)
            n = k * max(1, len(plan.steps) if plan is not None else 1)
            src = g.tensors[o.inputs[0]].placement
            n *= 1 if src == where else 2  # between placements: a send or receive, and an assembly
            for pl in {where, src}:
                if pl is not None:
                    tasks[pl] += n
                    regs[pl] += n
        else:
            tasks[where] += k
            regs[where] += k * len(o.outputs)
    for t in g.tensors.values():
        assert t.placement is not None
        k = 1 if t.kind in SOURCE_KINDS else m if t.kind is TensorKind.input else 0
        k += m if t.name in lay.accumulate and m > 1 else 0
        k += 1 if t.name in state.updates else 0
        tasks[t.placement] += k
        regs[t.placement] += k
        steps += k
    for name in {state.job.loss, *state.job.fetches} - {""}:  # a fetch's sink (a per-step value's: one)
        pl = g.tensors[name].placement
        assert pl is not None
        tasks[pl] += 1
        steps += 1
    per_rank: Counter[int] = Counter()
    reg_rank: Counter[int] = Counter()
    for pl, n in tasks.items():
        for r in pl.ranks:
            per_rank[r] += n
            reg_rank[r] += regs[pl]
    rank, most = max(per_rank.items(), key=lambda kv: kv[1], default=(0, 0))
    total = sum(n * pl.size for pl, n in tasks.items())
    return PlanSize(steps, total, rank, most, reg_rank[rank])


def check(state: CompileState, limits: Limits = LIMITS) -> PlanSize:
    """``estimate(state)``, refused (``CompileLimitError``) when a quantity is over ``limits``."""
    s = estimate(state)
    name = f"job {state.job.name!r} ({micro_batches(state.job)} micro-batches)"
    rows = (
        ("walk_steps", s.walk_steps, limits.walk_steps, f"{name}: lowering it takes {s.walk_steps:,} steps"),
        ("plan_tasks", s.tasks, limits.plan_tasks, f"{name}: its plan has {s.tasks:,} tasks over every rank"),
        (
            "rank_tasks",
            s.rank_tasks,
            limits.rank_tasks,
            f"{name}: rank {s.rank}'s plan has {s.rank_tasks:,} tasks",
        ),
        (
            "rank_registers",
            s.rank_registers,
            limits.rank_registers,
            f"{name}: rank {s.rank}'s plan has {s.rank_registers:,} registers",
        ),
        (
            "plan_bytes",
            s.plan_bytes,
            limits.plan_bytes,
            f"{name}: rank {s.rank}'s plan is ~{s.plan_bytes:,} bytes",
        ),
    )
    for quantity, value, limit, what in rows:
        _over(quantity, value, limit, what)
    return s


def _over(quantity: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise over_budget(quantity, limit, what)
