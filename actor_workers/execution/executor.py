"""The plan executor: a compiled Plan becomes one actor engine per rank, run together.

Per rank, every task of its DevicePlan becomes one actor (its act from :mod:`.tasks` or
:mod:`.boxing_tasks`) and every RegisterDesc one register; the plan's task order is the actors'
priority. Two things the plan leaves implicit are made explicit here:

* **loop edges** — a SOURCE (a variable) reads, from step 1 on, what the SINK that assigns the same
  variable wrote at the previous step; the edge's initial value is the store's (the initialised shard).
  A SINK that only stores one kernel's or update's output (directly, or through boxing steps that move
  nothing) has no actor: that act assigns and writes the edge (:func:`~.executor_analysis.folded_assigns`);
* **the communication order** — the communication stream is *ordered*: it acts in exactly the plan's
  order, step after step, and waits for the next task in that order even when a later one is ready.
  Lowering emits every rank's tasks, and every communicator's steps, in one global order, so all
  ranks issue their collectives and transfers in the same order (ARCHITECTURE.md, "Collective order":
  a rendezvous collective hangs when two ranks run two of them in different orders).

Everything comes from the plan: each task's mesh coordinate and, for boxing tasks, its step as data;
the plan's tables (:mod:`.plan_tables`: the tensors with their placements and nd-SBPs, the initialisers,
the data source, the config) for the rest. ``Plan.job`` is never read, and no boxing is re-planned. What
is read off the plan before the actors are built (loop edges, donated inputs, recycled buffers, boxings
that move nothing) is in :mod:`.executor_analysis`; the acts that only hand a value on (those boxings, the
variables' looped SOURCEs) are then bypassed (:mod:`.bypass`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow.actor_workers.execution import boxing_tasks, memory_plan, plan_tables, tasks
from sbpflow.actor_workers.execution import executor_analysis as analysis
from sbpflow.actor_workers.execution.bypass import bypass
from sbpflow.actor_workers.execution.executor_analysis import KIND, ExecutorError
from sbpflow.actor_workers.execution.plan_tables import PlanTables
from sbpflow.actor_workers.execution.tasks import Act, RankContext
from sbpflow.actor_workers.execution.variables import StoreSource, init_store
from sbpflow.actor_workers.runtime import heap
from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.cuda_streams import for_worker
from sbpflow.actor_workers.runtime.engine import AbortHook, Engine, RunResult
from sbpflow.actor_workers.runtime.group import EngineGroup
from sbpflow.actor_workers.runtime.trace import task_args
from sbpflow.codec import wire
from sbpflow.data.sources import DataSource
from sbpflow.graph import TensorDecl
from sbpflow.sharding import assemble_value
from sbpflow.v1 import plan_pb2 as pp

STREAMS = {
    pp.STREAM_KIND_COMPUTE: "compute",
    pp.STREAM_KIND_COMMUNICATION: "comm",
    pp.STREAM_KIND_DATA: "data",
}
COLLECTIVE = {v: k.removeprefix("COLLECTIVE_KIND_").lower() for k, v in pp.CollectiveKind.items()}


@dataclass
class RankProgram:
    """One rank's actors and registers, and the context their acts share (store, fetched values)."""

    rank: int
    actors: list[ActorSpec]
    registers: list[RegisterSpec]
    context: RankContext
    memory: memory_plan.MemoryPlan | None = None  # the registers sharing buffers (None: no plan)
    spent: bool = False  # an engine has taken its loop edges' initial values (:func:`engine`)


@dataclass
class Program:
    """Every rank's program, and what the executor needs to read results back (the plan's tables)."""

    tables: PlanTables
    ranks: dict[int, RankProgram] = field(default_factory=dict)

    @property
    def tensors(self) -> Mapping[str, TensorDecl]:
        return self.tables.tensors

    @property
    def loss(self) -> str:
        return self.tables.loss


def build(
    plan: pp.Plan,
    steps: int,
    transports: Mapping[int, Any] | None = None,
    xp: ModuleType = np,
    ranks: Collection[int] | None = None,
    first_step: int = 0,
    source: StoreSource | None = None,
    data_roots: tuple[str, ...] | None = None,
    plan_memory: bool = True,
    data: DataSource | None = None,
) -> Program:
    """One :class:`RankProgram` per device of ``plan`` (or of ``ranks`` only: a worker builds its own),
    each acting ``steps`` times, as steps ``first_step, first_step + 1, ...`` (a resumed run: the acts see
    the global step, which keys the data batch, the random draws and the learning-rate schedule).

    Everything is read from the plan's tasks, registers and tables (never ``plan.job``). ``transports``
    maps rank -> Transport. ``source`` gives the variables' starting shards (a checkpoint; default: the
    initializers). ``data_roots``: ``RunOptions.data_roots``, checked on every data file as it is opened.
    ``plan_memory``: registers share buffers by lifetime (:mod:`.memory_plan`; on a numpy rank).
    ``data``: the data source the plan's was written from, in this process (:func:`.plan_tables.of`).
    """
    tables = plan_tables.of(plan, data_roots, data)
    out = Program(tables)
    for device in plan.devices:
        if ranks is not None and device.rank not in ranks:
            continue
        transport = (transports or {}).get(device.rank)
        rc = RankContext(
            device.rank,
            tables,
            tables.micro_batches,
            init_store(tables, device.rank, xp, source),
            transport,
            xp,
            compute=for_worker(xp, transport),
            plan_memory=plan_memory,
        )
        out.ranks[device.rank] = build_rank(device, rc, steps, first_step)
    return out


def build_rank(device: pp.DevicePlan, rc: RankContext, steps: int, first_step: int = 0) -> RankProgram:
    """The actors of one rank's ``device`` plan on its context ``rc``, acting ``steps`` times from
    ``first_step``."""
    no_ops = analysis.pass_through(device)  # the boxing steps that move nothing and the copies handed on
    folded = analysis.folded_assigns(device, no_ops)
    gone = {r for f in folded.values() for r in (f.register, *f.passed)}
    skipped = {t for f in folded.values() for t in (f.sink, *f.steps)}  # the producer's act assigns
    registers = [
        RegisterSpec(r.id, r.producer_task, tuple(dict.fromkeys(r.consumer_tasks)), r.count)
        for r in device.registers
        if r.id not in gone
    ]
    loops = analysis.loop_edges(device, rc.store, registers, folded)
    assigns = analysis.by_producer(folded)
    donations = analysis.donations(device, no_ops)
    recyclers, guards = analysis.recyclers(device, rc.store if rc.xp is np else None)
    regs = {r.id: r for r in device.registers}
    looped = frozenset(t.id for t in device.tasks if t.id in loops and t.kind != pp.TASK_KIND_SOURCE)
    looped |= frozenset(assigns)  # kernels whose outputs loop to the next step
    memory = (
        memory_plan.plan(device, rc.tables.tensors, looped, no_ops)
        if rc.plan_memory and rc.xp is np
        else None
    )
    actors = []
    for priority, task in enumerate(device.tasks):
        if task.id in skipped:
            continue
        loop = loops.get(task.id)
        inputs = tuple(dict.fromkeys(task.in_registers))  # a kernel may read one register twice (x * x)
        outputs = tuple(task.out_registers)
        reads, initial = list(task.in_registers), {}
        if loop is not None and task.kind == pp.TASK_KIND_SOURCE:
            inputs, reads, initial = (loop.register,), [loop.register], {loop.register: loop.initial}
        elif loop is not None:
            outputs = (*outputs, loop.register)
        folds = assigns.get(task.id, ())
        act = _act(
            task,
            rc,
            regs,
            loop is not None or bool(folds),
            donations.get(task.id, frozenset()),
            recyclers.get(task.id),
            memory,
            task.id in no_ops,
        )
        if folds:  # each folded value goes into its loop edge in place of the register the SINK read
            edge = {f.register: loops[f.sink].register for f in folds}
            outputs = tuple(edge.get(r, r) for r in outputs)
            act = tasks.assigning(
                act, rc, [(list(task.out_registers).index(f.register), f.variable) for f in folds]
            )
        act = tasks.spread(act, [inputs.index(r) for r in reads], len(inputs))
        for recycler, register in guards.get(task.id, ()):
            owners = memory.owners if memory is not None else frozenset()
            act = tasks.guard_aliases(act, recycler, inputs.index(register), rc.xp, owners)
        planned = memory.reads(inputs, outputs) if memory is not None else []
        if planned:
            act = memory_plan.watch(act, planned)
        comm = task.stream == pp.STREAM_KIND_COMMUNICATION and task.id not in no_ops
        actors.append(
            ActorSpec(
                id=task.id,
                name=_name(task),
                stream="compute" if task.id in no_ops else STREAMS[task.stream],
                inputs=inputs,
                outputs=outputs,
                act=_offset(act if rc.compute is None else rc.compute.wrap(act, reads=not comm), first_step),
                iterations=steps,
                initial=initial,
                priority=-1 if _reports(task) else priority,
                op=_op(task),
                trace_args=task_args(task, regs),
            )
        )
    passing = no_ops | {t.id for t in device.tasks if t.kind == pp.TASK_KIND_SOURCE and t.id in loops}
    actors, registers = bypass(actors, registers, passing - guards.keys())
    return RankProgram(device.rank, actors, registers, rc, memory)


def _hand_on(step: int, values: list[Any]) -> list[Any]:
    """An identity kernel of :func:`~.executor_analysis.copies_to_hand_on` that bypass kept: its input
    as its output, as a boxing step that moves nothing."""
    return [values[0]]


def _offset(act: Act, first_step: int) -> Act:
    """``act`` seeing the global step: the engine counts its iterations from 0."""
    if not first_step:
        return act
    return lambda it, values: act(it + first_step, values)


def _act(
    task: pp.Task,
    rc: RankContext,
    regs: Mapping[int, pp.RegisterDesc],
    looped: bool,
    donated: frozenset[int] = frozenset(),
    recycle: tasks.Recycler | None = None,
    memory: memory_plan.MemoryPlan | None = None,
    hand_on: bool = False,
) -> Act:
    kind = task.kind
    if hand_on and kind == pp.TASK_KIND_KERNEL:  # a copy of :func:`~.executor_analysis.copies_to_hand_on`
        return _hand_on
    if kind in (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER):
        names = ([regs[r].tensor for r in task.in_registers], [regs[r].tensor for r in task.out_registers])
        reuse: tasks.Reuse | None = None
        if kind == pp.TASK_KIND_KERNEL and not looped and rc.xp is np and task.out_registers:
            reuse = tasks.OutputReuse([regs[r].count == 1 for r in task.out_registers])
            lender = memory.lender(task.out_registers, reuse) if memory is not None else None
            reuse = reuse if lender is None else lender
        return tasks.kernel_act(rc, task, names, donated, recycle, reuse)
    if kind == pp.TASK_KIND_DATA_LOAD:
        return tasks.data_load_act(rc, _tensor(rc, task), task.micro_batch, tuple(task.coord))
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
        step = boxing_tasks.step_of(task, rc.rank)
        out = regs[task.out_registers[0]] if task.out_registers else None
        dtype = None if out is None else wire.dtype_from_proto(out.dtype).to_numpy()
        return boxing_tasks.boxing_act(rc, task, step, dtype)
    raise ExecutorError(
        f"task {task.id} on rank {rc.rank} is of kind {KIND.get(kind, kind)}, which no act runs"
    )


def _tensor(rc: RankContext, task: pp.Task) -> TensorDecl:
    decl = rc.tables.tensors.get(task.op_name)
    if decl is None:
        raise ExecutorError(
            f"task {task.id} ({KIND[task.kind]}) on rank {rc.rank} loads {task.op_name!r}, which the plan's "
            "tensors do not have; the plan is inconsistent (recompile)"
        )
    return decl


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


def engine(rp: RankProgram, trace: bool = False, data_on_compute: bool = False) -> Engine:
    """The engine that runs one rank's program (its communication stream ordered). ``data_on_compute``:
    the data loads act on the compute thread (a worker with one CPU: see :mod:`.engine`'s ``run_on``).

    A rank's program runs once: the engine takes its loop edges' initial values (the variables' values
    at the first step), and the program keeps none of them, so that nothing holds them once the first
    update has read them (BERT's parameters: 20 MB held to the end of the run). :func:`rebuild` (or
    :func:`build`) makes the next one."""
    if rp.spent:
        raise ExecutorError(
            f"rank {rp.rank}: this RankProgram has run (its engine took the variables' first values); "
            "a program runs once: build it again (executor.build or executor.rebuild) to run more steps"
        )
    made = Engine(
        rp.actors,
        rp.registers,
        trace,
        rank=rp.rank,
        ordered_streams=ORDERED_STREAMS,
        busy=rp.context.busy,
        run_on={"data": "compute"} if data_on_compute else None,
    )
    rp.actors = [dataclasses.replace(a, initial={}) if a.initial else a for a in rp.actors]
    rp.spent = True
    return made


def execute(
    program: Program,
    timeout: float,
    trace: bool = False,
    abort_hooks: Sequence[AbortHook] = (),
    cancel: threading.Event | None = None,
) -> dict[int, RunResult]:
    """Run every rank's engine together until all actors are done; the first failure stops all of them
    (and calls ``abort_hooks``, e.g. the transports' abort) and is raised as a RuntimeFailure. Setting
    ``cancel`` stops them all the same way. The heap as it stands is left out of the cycle collector's
    walks while they run (``heap.frozen``)."""
    return execute_ranks(list(program.ranks.values()), timeout, trace, abort_hooks, cancel)


def execute_ranks(
    ranks: Sequence[RankProgram],
    timeout: float,
    trace: bool = False,
    abort_hooks: Sequence[AbortHook] = (),
    cancel: threading.Event | None = None,
) -> dict[int, RunResult]:
    """:func:`execute` on some ranks' programs (a segment of a run, :mod:`.segments`)."""
    engines = [engine(rp, trace) for rp in sorted(ranks, key=lambda rp: rp.rank)]
    with heap.frozen():  # the collector walks what the steps make, not the plan (heap.py)
        return EngineGroup(engines, abort_hooks).run(timeout, cancel)


# ---- results -----------------------------------------------------------------------------------------


def gather(program: Program, name: str, values: Mapping[int, Any], xp: ModuleType = np) -> Any:
    """The logical value of tensor ``name`` from each rank's shard (splits concatenated, partials summed,
    broadcast copies checked equal)."""
    return assemble_value(program.tensors[name], dict(values), xp)


def fetched(program: Program, name: str, steps: int, micro_batch: int = -1, first_step: int = 0) -> list[Any]:
    """Per step from ``first_step`` on, the logical value the SINK ``fetch`` tasks of ``name`` recorded."""
    decl = program.tensors[name]
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
        decl = program.tensors[name]
        assert decl.placement is not None
        out[name] = gather(
            program, name, {r: program.ranks[r].context.store[name] for r in decl.placement.ranks}
        )
    return out


def rebuild(program: Program, plan: pp.Plan, steps: int, first_step: int) -> None:
    """Every rank of ``program`` rebuilt to act ``steps`` more times from ``first_step`` on the context it
    has (store, hooks, fetched values): the next segment of a run an evaluation paused (:mod:`.segments`).
    Its loop edges start from the store, which holds what the last segment assigned."""
    for device in plan.devices:
        rp = program.ranks.get(device.rank)
        if rp is not None:
            program.ranks[device.rank] = build_rank(device, rp.context, steps, first_step)


def _reports(task: pp.Task) -> bool:
    """A SINK that fetches a value (the loss, a metric) on the compute stream: it acts as soon as its value
    is in, ahead of any other ready act (the lowest priority acts first). At its place in the plan's order
    it waited until nothing earlier was ready: a rank that may run steps ahead (Wide & Deep on one rank:
    four) fetched its losses, and reported its steps, four at a time."""
    return task.kind == pp.TASK_KIND_SINK and "fetch" in task.attrs and task.stream == pp.STREAM_KIND_COMPUTE
