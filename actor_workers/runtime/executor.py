"""The plan executor: a compiled Plan becomes one actor engine per rank, run together.

Per rank, every task of its DevicePlan becomes one actor (its act from :mod:`.tasks` or
:mod:`.boxing_tasks`) and every RegisterDesc one register; the plan's task order is the actors'
priority. Two things the plan leaves implicit are made explicit here:

* **loop edges** — a SOURCE (a variable) reads, from step 1 on, what the SINK that assigns the same
  variable wrote at the previous step; the edge's initial value is the store's (the initialised shard);
* **the communication order** — the communication stream is *ordered*: it acts in exactly the plan's
  order, step after step, and waits for the next task in that order even when a later one is ready.
  Lowering emits every rank's tasks, and every communicator's steps, in one global order, so all
  ranks issue their collectives and transfers in the same order (ARCHITECTURE.md, "Collective order":
  a rendezvous collective hangs when two ranks run two of them in different orders).

The compiled job supplies what the Plan does not carry per task: the tensors' placements and nd-SBPs
(the shard each rank holds) and, for boxing tasks, the regions of each transfer (re-planned with
:func:`plan_boxing` from the boxing node, as lowering does).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow import wire
from sbpflow.actor_workers.progress import assemble_value
from sbpflow.actor_workers.runtime import boxing_tasks, tasks
from sbpflow.actor_workers.runtime.actor import ActorSpec
from sbpflow.actor_workers.runtime.engine import AbortHook, Engine, RunResult
from sbpflow.actor_workers.runtime.group import EngineGroup
from sbpflow.actor_workers.runtime.register import RegisterSpec
from sbpflow.actor_workers.runtime.store import Store, StoreSource, init_store
from sbpflow.actor_workers.runtime.tasks import Act, RankContext
from sbpflow.control_plane.compiler.boxing import BoxingPlan, Collective, plan_boxing
from sbpflow.errors import SbpflowError
from sbpflow.graph import BOXING, Graph, OpNode
from sbpflow.job import Job
from sbpflow.reference import micro_batches
from sbpflow.v1 import plan_pb2 as pp

STREAMS = {
    pp.STREAM_KIND_COMPUTE: "compute",
    pp.STREAM_KIND_COMMUNICATION: "comm",
    pp.STREAM_KIND_DATA: "data",
}
KIND = {v: k.removeprefix("TASK_KIND_").lower() for k, v in pp.TaskKind.items()}
COLLECTIVE = {v: k.removeprefix("COLLECTIVE_KIND_").lower() for k, v in pp.CollectiveKind.items()}


class ExecutorError(SbpflowError, ValueError):
    """A plan the executor cannot turn into actors (a task it does not know, a missing op or tensor)."""


@dataclass
class RankProgram:
    """One rank's actors and registers, and the context their acts share (store, fetched values)."""

    rank: int
    actors: list[ActorSpec]
    registers: list[RegisterSpec]
    context: RankContext


@dataclass
class Program:
    """Every rank's program, and what the executor needs to read results back."""

    job: Job  # the compiled job
    ranks: dict[int, RankProgram] = field(default_factory=dict)

    @property
    def graph(self) -> Graph:
        return self.job.graph


def compiled_job(plan: pp.Plan) -> Job:
    """The compiled job a plan carries (per-micro-batch graph with placements and SBPs)."""
    return wire.job_from_proto(plan.job)


def build(
    plan: pp.Plan,
    steps: int,
    transports: Mapping[int, Any] | None = None,
    job: Job | None = None,
    boxings: Mapping[str, BoxingPlan] | None = None,
    xp: ModuleType = np,
    ranks: Collection[int] | None = None,
    first_step: int = 0,
    source: StoreSource | None = None,
) -> Program:
    """One :class:`RankProgram` per device of ``plan`` (or of ``ranks`` only: a worker builds its own),
    each acting ``steps`` times, as steps ``first_step, first_step + 1, ...`` (a resumed run: the acts see
    the global step, which keys the data batch, the random draws and the learning-rate schedule).

    ``job`` is the compiled job (default: decoded from ``plan.job``); ``boxings`` the compiler's boxing
    plans by node name (default: re-planned). ``transports`` maps rank -> Transport. ``source`` gives
    the variables' starting shards (a checkpoint; default: the initializers).
    """
    job = job if job is not None else compiled_job(plan)
    nodes = {o.name: o for o in job.graph.ops}
    comm_ranks = {c.id: tuple(c.ranks) for c in plan.communicators}
    out = Program(job)
    for device in plan.devices:
        if ranks is not None and device.rank not in ranks:
            continue
        rc = RankContext(
            device.rank,
            job,
            micro_batches(job),
            init_store(job, job.graph, device.rank, xp, source),
            (transports or {}).get(device.rank),
            xp,
        )
        out.ranks[device.rank] = _build_rank(device, rc, steps, nodes, boxings or {}, comm_ranks, first_step)
    return out


def _build_rank(
    device: pp.DevicePlan,
    rc: RankContext,
    steps: int,
    nodes: Mapping[str, OpNode],
    boxings: Mapping[str, BoxingPlan],
    comm_ranks: Mapping[str, tuple[int, ...]],
    first_step: int = 0,
) -> RankProgram:
    registers = [
        RegisterSpec(r.id, r.producer_task, tuple(dict.fromkeys(r.consumer_tasks)), r.count)
        for r in device.registers
    ]
    loops = _loop_edges(device, rc.store, registers)
    donations = _donations(device)
    recyclers, guards = _recyclers(device)
    no_ops = _no_op_boxings(device, rc, nodes, boxings)
    actors = []
    for priority, task in enumerate(device.tasks):
        loop = loops.get(task.id)
        inputs = tuple(dict.fromkeys(task.in_registers))  # a kernel may read one register twice (x * x)
        outputs = tuple(task.out_registers)
        reads, initial = list(task.in_registers), {}
        if loop is not None and task.kind == pp.TASK_KIND_SOURCE:
            inputs, reads, initial = (loop.register,), [loop.register], {loop.register: loop.initial}
        elif loop is not None:
            outputs = (*outputs, loop.register)
        act = tasks.spread(
            _act(
                task,
                rc,
                nodes,
                boxings,
                comm_ranks,
                loop is not None,
                donations.get(task.id, frozenset()),
                recyclers.get(task.id),
            ),
            [inputs.index(r) for r in reads],
            len(inputs),
        )
        for recycler, register in guards.get(task.id, ()):
            act = tasks.guard_aliases(act, recycler, inputs.index(register), rc.xp)
        actors.append(
            ActorSpec(
                id=task.id,
                name=_name(task),
                stream="compute" if task.id in no_ops else STREAMS[task.stream],
                inputs=inputs,
                outputs=outputs,
                act=_offset(act, first_step),
                iterations=steps,
                initial=initial,
                priority=priority,
                op=_op(task),
                trace_args={"micro_batch": task.micro_batch, "task": task.id},
            )
        )
    return RankProgram(device.rank, actors, registers, rc)


def _offset(act: Act, first_step: int) -> Act:
    """``act`` seeing the global step: the engine counts its iterations from 0."""
    if not first_step:
        return act
    return lambda it, values: act(it + first_step, values)


@dataclass(frozen=True)
class _Loop:
    register: int
    initial: Any  # the value the SOURCE reads at step 0


def _loop_edges(device: pp.DevicePlan, store: Store, registers: list[RegisterSpec]) -> dict[int, _Loop]:
    """SINK assign of a variable -> SOURCE of the same variable at the next step: a register from the
    one to the other whose initial value is the store's; keyed by both tasks' ids."""
    sources = {t.op_name: t for t in device.tasks if t.kind == pp.TASK_KIND_SOURCE}
    ids = itertools.count(max((r.id for r in device.registers), default=-1) + 1)
    loops: dict[int, _Loop] = {}
    for sink in device.tasks:
        if sink.kind != pp.TASK_KIND_SINK or "assign" not in sink.attrs:
            continue
        var = str(wire.attr_from_proto(sink.attrs["assign"]))
        source = sources.get(var)
        if source is None:
            raise ExecutorError(
                f"rank {device.rank}: task {sink.id} assigns {var!r}, which no SOURCE task of this rank holds"
            )
        loop = _Loop(next(ids), store[var])
        registers.append(RegisterSpec(loop.register, sink.id, (source.id,), 1))
        loops[sink.id] = loops[source.id] = loop
    return loops


def _no_op_boxings(
    device: pp.DevicePlan, rc: RankContext, nodes: Mapping[str, OpNode], boxings: Mapping[str, BoxingPlan]
) -> set[int]:
    """Boxing tasks to run on the compute stream instead of the communication stream: steps that move
    nothing (an identity, or a group of one: every step on one device) between a compute producer and
    compute consumers — a gradient's ``P -> B`` on one device, say. On the communication stream each
    would wake its thread and back for a no-op on the step's critical path. The choice is made from the
    plan alone, so it is the same on every rank, and the collectives keep their order."""
    streams = {t.id: t.stream for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    out = set()
    for task in device.tasks:
        if task.kind != pp.TASK_KIND_BOXING or task.stream != pp.STREAM_KIND_COMMUNICATION:
            continue
        neighbours = [regs[r].producer_task for r in task.in_registers]
        neighbours += [c for r in task.out_registers for c in regs[r].consumer_tasks]
        if any(streams.get(n) != pp.STREAM_KIND_COMPUTE for n in neighbours):
            continue
        node = _node(nodes, task)
        plan = boxings.get(node.name) or _plan_of(rc.job.graph, node)
        _, step = boxing_tasks.find_step(plan, node.name, task.boxing.from_sbp, task.boxing.to_sbp)
        k = step.mesh_axis
        if step.collective is not Collective.p2p and (
            step.from_sbp == step.to_sbp or (k is not None and plan.src.shape[k] == 1)
        ):
            out.add(task.id)
    return out


def _donations(device: pp.DevicePlan) -> dict[int, frozenset[int]]:
    """Per kernel task, the input positions whose arrays it may overwrite (an optimizer state's buffer).

    A variable's value is given away to the one kernel that reads it when nobody else ever holds that
    array: the kernel is the only consumer of the SOURCE's register (reading it once), and the value the
    SINK assigns (next step's SOURCE value) is an output of that same kernel that only the SINK reads. So
    the array circulates kernel -> SINK -> SOURCE -> kernel, read once per step, and the kernel can update
    it in place instead of allocating a new one. Unlooped sources (never assigned: the store's own array,
    re-read every step) are never donated.
    """
    by_id = {t.id: t for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    sinks = {
        str(wire.attr_from_proto(t.attrs["assign"])): t
        for t in device.tasks
        if t.kind == pp.TASK_KIND_SINK and "assign" in t.attrs
    }
    out: dict[int, set[int]] = {}
    for source in device.tasks:
        sink = sinks.get(source.op_name)
        if source.kind != pp.TASK_KIND_SOURCE or sink is None or len(sink.in_registers) != 1:
            continue
        back = regs[sink.in_registers[0]]
        for r in source.out_registers:
            readers = set(regs[r].consumer_tasks)
            if len(readers) != 1:
                continue
            reader = by_id[readers.pop()]
            ins = list(reader.in_registers)
            if (
                reader.kind in (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER)
                and ins.count(r) == 1
                and back.producer_task == reader.id
                and set(back.consumer_tasks) == {sink.id}
            ):
                out.setdefault(reader.id, set()).add(ins.index(r))
    return {t: frozenset(p) for t, p in out.items()}


# Readers that never keep a variable's array past their act (a SINK fetch records it: not recyclable).
_TRANSIENT_READERS = (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER, pp.TASK_KIND_BOXING, pp.TASK_KIND_SEND)


def _recyclers(
    device: pp.DevicePlan,
) -> tuple[dict[int, tasks.Recycler], dict[int, list[tuple[tasks.Recycler, int]]]]:
    """Per update task, the :class:`~.tasks.Recycler` of the variable it updates (its input 0), where the
    variable's SOURCE is looped, emits into one-slot registers only, and only transient readers read them;
    and per reader task, the (recycler, register) pairs whose outputs to watch for views."""
    by_id = {t.id: t for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    assigned = {
        str(wire.attr_from_proto(t.attrs["assign"]))
        for t in device.tasks
        if t.kind == pp.TASK_KIND_SINK and "assign" in t.attrs
    }
    recyclers: dict[int, tasks.Recycler] = {}
    guards: dict[int, list[tuple[tasks.Recycler, int]]] = {}
    for update in device.tasks:
        if update.kind != pp.TASK_KIND_OPTIMIZER or not update.in_registers:
            continue
        source = by_id.get(regs[update.in_registers[0]].producer_task)
        if source is None or source.kind != pp.TASK_KIND_SOURCE or source.op_name not in assigned:
            continue
        outs = [regs[r] for r in source.out_registers]
        readers = {c for r in outs for c in r.consumer_tasks}
        if any(r.count != 1 for r in outs) or any(by_id[c].kind not in _TRANSIENT_READERS for c in readers):
            continue
        recycler = recyclers[update.id] = tasks.Recycler(input=0)
        for r in outs:
            for c in dict.fromkeys(r.consumer_tasks):
                if c != update.id:
                    guards.setdefault(c, []).append((recycler, r.id))
    return recyclers, guards


def _act(
    task: pp.Task,
    rc: RankContext,
    nodes: Mapping[str, OpNode],
    boxings: Mapping[str, BoxingPlan],
    comm_ranks: Mapping[str, tuple[int, ...]],
    looped: bool,
    donated: frozenset[int] = frozenset(),
    recycle: tasks.Recycler | None = None,
) -> Act:
    g = rc.job.graph
    kind = task.kind
    if kind in (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER):
        return tasks.kernel_act(rc, _node(nodes, task), task.micro_batch, donated, recycle)
    if kind == pp.TASK_KIND_DATA_LOAD:
        return tasks.data_load_act(rc, g.tensors[task.op_name], task.micro_batch)
    if kind == pp.TASK_KIND_ACCUMULATE:
        first = bool(wire.attr_from_proto(task.attrs["first"]))
        divide_by = wire.attr_from_proto(task.attrs["divide_by"])
        assert isinstance(divide_by, int)
        return tasks.accumulate_act(rc, first, divide_by)
    if kind == pp.TASK_KIND_SOURCE:
        return tasks.source_act(rc, task.op_name, looped)
    if kind == pp.TASK_KIND_SINK:
        if "assign" in task.attrs:
            return tasks.assign_act(rc, str(wire.attr_from_proto(task.attrs["assign"])), looped)
        return tasks.fetch_act(rc, str(wire.attr_from_proto(task.attrs["fetch"])), task.micro_batch)
    if kind in (pp.TASK_KIND_BOXING, pp.TASK_KIND_SEND, pp.TASK_KIND_RECV):
        node = _node(nodes, task)
        plan = boxings.get(node.name) or _plan_of(g, node)
        step_no, step = boxing_tasks.find_step(plan, node.name, task.boxing.from_sbp, task.boxing.to_sbp)
        peer = None
        if kind != pp.TASK_KIND_BOXING:
            peer = next((r for r in comm_ranks.get(task.communicator, ()) if r != rc.rank), None)
            if peer is None:
                raise ExecutorError(
                    f"{_name(task)} on rank {rc.rank}: communicator {task.communicator!r} has no peer"
                )
        return boxing_tasks.boxing_act(rc, task, plan, step_no, step, peer)
    raise ExecutorError(
        f"task {task.id} on rank {rc.rank} is of kind {KIND.get(kind, kind)}, which no act runs"
    )


def _node(nodes: Mapping[str, OpNode], task: pp.Task) -> OpNode:
    node = nodes.get(task.op_name)
    if node is None:
        raise ExecutorError(
            f"task {task.id} ({KIND[task.kind]}) runs op {task.op_name!r}, which the compiled graph does not have; "
            "the plan and its job disagree (recompile)"
        )
    return node


def _plan_of(g: Graph, node: OpNode) -> BoxingPlan:
    assert node.op_type == BOXING
    src, dst = g.tensors[node.inputs[0]], g.tensors[node.outputs[0]]
    assert src.placement and src.sbp is not None and dst.placement and dst.sbp is not None
    return plan_boxing(src.meta, src.placement, src.sbp, dst.placement, dst.sbp)


def _name(task: pp.Task) -> str:
    mb = f" mb{task.micro_batch}" if task.micro_batch >= 0 else ""
    what = task.op_name or f"task {task.id}"
    if task.kind in (pp.TASK_KIND_BOXING, pp.TASK_KIND_SEND, pp.TASK_KIND_RECV):
        return f"{KIND[task.kind]} {what} [{task.boxing.from_sbp} -> {task.boxing.to_sbp}]{mb}"
    return f"{KIND[task.kind]} {what}{mb}"


def _op(task: pp.Task) -> str:
    if task.op_type:
        return task.op_type
    if task.kind in (pp.TASK_KIND_BOXING, pp.TASK_KIND_SEND, pp.TASK_KIND_RECV):
        return COLLECTIVE[task.boxing.collective]
    return KIND[task.kind]


# ---- running -----------------------------------------------------------------------------------------

ORDERED_STREAMS = ("comm",)


def engine(rp: RankProgram, trace: bool = False) -> Engine:
    """The engine that runs one rank's program (its communication stream ordered)."""
    return Engine(rp.actors, rp.registers, trace, rank=rp.rank, ordered_streams=ORDERED_STREAMS)


def execute(
    program: Program,
    timeout: float,
    trace: bool = False,
    abort_hooks: Sequence[AbortHook] = (),
    cancel: threading.Event | None = None,
) -> dict[int, RunResult]:
    """Run every rank's engine together until all actors are done; the first failure stops all of them
    (and calls ``abort_hooks``, e.g. the transports' abort) and is raised as a RuntimeFailure. Setting
    ``cancel`` stops them all the same way."""
    engines = [engine(rp, trace) for _, rp in sorted(program.ranks.items())]
    return EngineGroup(engines, abort_hooks).run(timeout, cancel)


# ---- results -----------------------------------------------------------------------------------------


def gather(program: Program, name: str, values: Mapping[int, Any], xp: ModuleType = np) -> Any:
    """The logical value of tensor ``name`` from each rank's shard (splits concatenated, partials summed,
    broadcast copies checked equal)."""
    return assemble_value(program.graph.tensors[name], dict(values), xp)


def fetched(program: Program, name: str, steps: int, micro_batch: int = -1, first_step: int = 0) -> list[Any]:
    """Per step from ``first_step`` on, the logical value the SINK ``fetch`` tasks of ``name`` recorded."""
    decl = program.graph.tensors[name]
    assert decl.placement is not None
    per_rank = {
        r: program.ranks[r].context.fetched.get((name, micro_batch), {}) for r in decl.placement.ranks
    }
    steps_run = range(first_step, first_step + steps)
    return [gather(program, name, {r: v[s] for r, v in per_rank.items()}) for s in steps_run]


def variables(program: Program, names: Sequence[str]) -> dict[str, Any]:
    """The logical value of each variable in ``names`` from the ranks' stores."""
    out = {}
    for name in names:
        decl = program.graph.tensors[name]
        assert decl.placement is not None
        out[name] = gather(
            program, name, {r: program.ranks[r].context.store[name] for r in decl.placement.ranks}
        )
    return out
