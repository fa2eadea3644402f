"""Lowering: the compiled logical graph becomes the physical Plan — per rank, tasks and their registers.

Input contract (the state after boxing): every tensor has a placement and an nd-SBP, every op reads its
inputs on its own placement with the SBP its signature needs, and each BOXING node has its plan in
``state.boxings`` (planned here when missing). One task (one actor) per (op, rank):

    what                           task          stream          registers written
    parameter / optimizer state    SOURCE        compute         its local shard, 1 buffer
    input (data source)            DATA_LOAD     data            its local shard, 2 buffers (prefetch)
    op of the library              KERNEL        compute         one per output, 1 buffer
    sgd_update / adamw_update      OPTIMIZER     compute         one per output, 1 buffer
    boxing step (collective)       BOXING        communication   the shard after the step
    boxing across placements       SEND / RECV   communication   the received piece (on the receiver)
    update (state.updates)         SINK assign   compute         —   (writes the persistent store)
    loss, fetches                  SINK fetch    compute         —   (reports the value)

A boxing plan with several steps becomes one task per step per rank (the planner's steps are each one
group collective; a task per step lets the runtime execute exactly one primitive per actor and lets
the communicator order name each collective). Between placements, each (source, destination) pair with
a transfer is a SEND on the source and a RECV on the destination, on the pair's communicator; a
destination that needs more than that one piece (its own copy, several sources) assembles them in a
BOXING task marked ``local slice``, and a destination that only holds zeros (P) gets a ``zero fill``.
Boxing tasks carry the boxing node's name in ``op_name`` so the runtime can re-plan the transfers'
regions with :func:`plan_boxing` (a cached pure function of the job).

Register bytes are the LOCAL shard bytes on that rank, so uneven splits are exact.

On demand: ``lower(state, ranks=[r])`` builds only rank ``r``'s DevicePlan, equal (ids, registers,
communicator positions) to the one in the full plan. Ids and ``comm_seq`` are positions in one global
walk, and every emission knows how many tasks and registers each rank of its placement adds, so the
walk only counts the other ranks' tasks instead of building them; every call on a communicator of ``r``
involves ``r``, so its positions there are exact. A control plane ships each worker only its DevicePlan,
and a 1024-device job never has to hold 26 million tasks in one process (``pipeline.compile`` chooses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

from sbpflow import wire
from sbpflow.control_plane.compiler import comm_order, micro_batching
from sbpflow.control_plane.compiler.boxing import BoxingPlan, BoxingStep, Collective, Transfer, plan_boxing
from sbpflow.control_plane.compiler.comm_order import Call, CommOrder, GroupCall, call_kind, pair_ranks
from sbpflow.control_plane.compiler.micro_batching import Layout
from sbpflow.control_plane.compiler.schedule import Phase
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.dtype import DType
from sbpflow.errors import SbpflowError
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.placement import Placement
from sbpflow.sbp import B, NdSbp, format_nd
from sbpflow.sharding import local_shape, shard_index, split_range
from sbpflow.tensor_meta import Shape
from sbpflow.v1 import plan_pb2 as pp

PLAN_FORMAT_VERSION = 1

K = pp.TaskKind
STREAM: dict[int, int] = {
    K.TASK_KIND_KERNEL: pp.STREAM_KIND_COMPUTE,
    K.TASK_KIND_OPTIMIZER: pp.STREAM_KIND_COMPUTE,
    K.TASK_KIND_SOURCE: pp.STREAM_KIND_COMPUTE,
    K.TASK_KIND_SINK: pp.STREAM_KIND_COMPUTE,
    K.TASK_KIND_BOXING: pp.STREAM_KIND_COMMUNICATION,
    K.TASK_KIND_SEND: pp.STREAM_KIND_COMMUNICATION,
    K.TASK_KIND_RECV: pp.STREAM_KIND_COMMUNICATION,
    K.TASK_KIND_DATA_LOAD: pp.STREAM_KIND_DATA,
    K.TASK_KIND_ACCUMULATE: pp.STREAM_KIND_COMPUTE,
}
# A data loader fills the next batch while the current one is computed on; everything else has one.
REGISTER_COUNT: dict[int, int] = {K.TASK_KIND_DATA_LOAD: 2}
SOURCE_KINDS = {TensorKind.parameter, TensorKind.optimizer_state, TensorKind.constant}
OPTIMIZER_OPS = frozenset({"sgd_update", "adamw_update"})

COLLECTIVE = {
    Collective.all_reduce: pp.COLLECTIVE_KIND_ALL_REDUCE,
    Collective.reduce_scatter: pp.COLLECTIVE_KIND_REDUCE_SCATTER,
    Collective.all_gather: pp.COLLECTIVE_KIND_ALL_GATHER,
    Collective.all_to_all: pp.COLLECTIVE_KIND_ALL_TO_ALL,
    Collective.local_slice: pp.COLLECTIVE_KIND_LOCAL_SLICE,
    Collective.zero_fill: pp.COLLECTIVE_KIND_ZERO_FILL,
}
LOCAL = {Collective.local_slice, Collective.zero_fill}


class LoweringError(SbpflowError, ValueError):
    """The graph does not satisfy lowering's input contract (layout missing or inconsistent)."""


# Above this many tasks (every rank's together) ``pipeline.compile(lower="auto")`` stops materialising the
# whole Plan and lowers ranks on demand: at ~20 us a task, 500 000 tasks are ~10 s and ~1 GB of protobuf.
LAZY_ABOVE = 500_000


@dataclass(frozen=True)
class Lowered:
    """One walk of the lowering: the DevicePlans of the ranks asked for, with ids and communicator
    positions equal to those of the full plan, and the totals over every rank (built or not)."""

    devices: dict[int, pp.DevicePlan]
    communicators: list[pp.Communicator]  # those the built ranks are members of; only their steps
    tasks: int
    registers: int
    trail: list[tuple[str, BoxingPlan, int]] | None  # (boxing op, plan, step) in the global order, if asked


def run(state: CompileState, job_id: str = "") -> pp.Plan:
    """The physical plan of ``state.graph``, every rank's tasks; ``state`` is not changed."""
    return to_plan(state, lower(state), job_id)


def to_plan(state: CompileState, low: Lowered, job_id: str = "") -> pp.Plan:
    return pp.Plan(
        format_version=PLAN_FORMAT_VERSION,
        job_id=job_id,
        devices=[low.devices[r] for r in sorted(low.devices)],
        communicators=low.communicators,
        job=wire.job_to_proto(dataclasses.replace(state.job, graph=state.graph)),
    )


def lower(state: CompileState, ranks: Iterable[int] | None = None, log: bool = False) -> Lowered:
    """Walk the graph in the one global order and build the tasks of ``ranks`` (default: all).

    The walk visits every (op, micro-batch) of every rank, but an emission whose placement holds none of
    ``ranks`` only advances the id counters (by its placement's size), so one rank of a 1024-device job
    costs its own tasks plus a few microseconds per emission: its DevicePlan is the full plan's, id for id,
    without the other ranks' tasks. ``log=True`` also records every communicator call of every rank in
    order (what :func:`comm_order.check_calls` proves deadlock-free without the tasks).
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
    low = _Lowerer(g, devices, keep, trail=[] if log else None)
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


def check_order(low: Lowered) -> int:
    """The graph-level communicator check (``comm_order`` docstring) of a walk made with ``log=True``:
    every communicator's order is the projection of the walk's one sequence of boxing steps, so it is
    enough that each distinct step's calls, as lowering emits them for every rank, involve every member
    of their communicator once with matching primitives. Returns the number of distinct steps checked."""
    assert low.trail is not None, "lower(..., log=True) records the walk's boxing steps"
    seen: set[tuple[int, int]] = set()
    for op_name, plan, i in low.trail:
        if (id(plan), i) not in seen:
            seen.add((id(plan), i))
            comm_order.check_calls(step_calls(op_name, plan, i))
    return len(seen)


def step_calls(op_name: str, plan: BoxingPlan, i: int) -> list[GroupCall]:
    """Every rank's communicator calls of step ``i`` of ``plan``, emitted by lowering's own code (no
    rank built: only the calls are recorded)."""
    low = _Lowerer(Graph(), {}, frozenset(), CommOrder(log=[]))
    low.keep = None  # every group and destination, though no task is built
    op = OpNode(op_name, BOXING, (), ())
    step = plan.steps[i]
    if step.collective is Collective.p2p:
        low._p2p(op, plan, step, {}, "")
    else:
        low._collective(op, plan, step, {}, "")
    assert low.comm.log is not None
    return low.comm.log


def estimate_tasks(state: CompileState) -> int:
    """About how many tasks the full plan has (one per op, rank and micro-batch; a boxing op counted as
    one step): what decides whether ``pipeline.compile`` materialises the Plan, without lowering."""
    lay = micro_batching.layout(state)
    g, m = state.graph, lay.micro_batches
    return sum(_placement_of(g, o).size * (m if o.name in lay.slot_of else 1) for o in g.ops)


def _micro_batches(
    state: CompileState, lay: Layout, low: _Lowerer, ops: dict[str, OpNode], fetched: set[str]
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


def plan_of(g: Graph, op: OpNode) -> BoxingPlan:
    src, dst = g.tensors[op.inputs[0]], g.tensors[op.outputs[0]]
    assert src.placement and src.sbp is not None and dst.placement and dst.sbp is not None
    return plan_boxing(src.meta, src.placement, src.sbp, dst.placement, dst.sbp)


def _placement_of(g: Graph, op: OpNode) -> Placement:
    where = op.placement or g.tensors[op.outputs[0]].placement
    assert where is not None
    return where


@lru_cache(maxsize=4096)
def _coords(pl: Placement) -> tuple[tuple[int, ...], ...]:
    return tuple(pl.coords())


@lru_cache(maxsize=1 << 16)
def shard_shape(
    shape: Shape, mesh: tuple[int, ...], nd_sbp: NdSbp, coord: tuple[int, ...]
) -> tuple[int, ...]:
    """``local_shape``, cached: a big job asks for the same few shard shapes millions of times."""
    return tuple(local_shape(shape, mesh, nd_sbp, coord))


@dataclass(frozen=True)
class _Dest:
    """One destination of a point-to-point step: the pieces it gets, by source, in the plan's order."""

    coord: tuple[int, ...]
    rank: int
    want: tuple[int, ...]
    sources: tuple[tuple[int, int, tuple[int, ...]], ...]  # (source rank, bytes, shape the piece arrives in)
    whole: bool  # one received piece is the whole shard: no assembling task


@dataclass(frozen=True)
class _P2P:
    """A point-to-point step's destinations, where each starts in the id counters, and who touches which."""

    step: BoxingStep  # kept alive: the lowerer caches this by ``id(step)``
    dests: list[_Dest]
    starts: list[tuple[int, int]]  # (tasks, registers) emitted before each destination, over all ranks
    total: tuple[int, int]
    touching: dict[int, list[int]]  # rank -> the destinations whose transfers involve it


def _p2p_layout(plan: BoxingPlan, step: BoxingStep) -> _P2P:
    meta, dst = plan.meta, plan.dst
    by_dst: dict[int, dict[int, list[Transfer]]] = {}
    for tr in step.transfers:
        by_dst.setdefault(tr.dst, {}).setdefault(tr.src, []).append(tr)
    dests: list[_Dest] = []
    starts: list[tuple[int, int]] = []
    touching: dict[int, list[int]] = {}
    tasks = registers = 0
    for coord in _coords(dst):
        d = dst.rank_at(coord)
        want = shard_shape(meta.shape, dst.shape, step.to_sbp, coord)
        sources = []
        for s, trs in by_dst.get(d, {}).items():
            numel = sum(t.numel for t in trs)
            # one region arrives in its own shape; several (a shard cut by several source shards) packed
            shape = tuple(r.stop - r.start for r in trs[0].region) if len(trs) == 1 else (numel,)
            sources.append((s, numel * meta.dtype.itemsize, shape))
        whole = len(sources) == 1 and sources[0][0] != d and sources[0][2] == want
        for r in {d, *(s for s, _, _ in sources)}:
            touching.setdefault(r, []).append(len(dests))
        dests.append(_Dest(coord, d, want, tuple(sources), whole))
        starts.append((tasks, registers))
        pairs = sum(s != d for s, _, _ in sources)
        tasks, registers = tasks + 2 * pairs + (not whole), registers + pairs + (not whole)
    return _P2P(step, dests, starts, (tasks, registers), touching)


@dataclass
class _Lowerer:
    graph: Graph
    devices: dict[int, pp.DevicePlan]  # the ranks whose tasks are built
    keep: frozenset[int] | None = None  # those ranks; None: every rank
    comm: CommOrder = field(default_factory=CommOrder)
    held: dict[tuple[str, int, int], int] = field(
        default_factory=dict
    )  # (tensor, rank, micro-batch) -> register
    micro_batch: int = -1  # of the tasks being emitted; -1 = once per step
    registers: dict[int, pp.RegisterDesc] = field(default_factory=dict)
    next_task: int = 0  # ids count every rank's tasks and registers, built or not
    next_reg: int = 0
    _chosen: dict[Placement, list[int]] = field(default_factory=dict)
    _groups: dict[tuple[Placement, int], list[list[tuple[int, ...]]]] = field(default_factory=dict)
    _attrs: dict[str, list[tuple[str, object]]] = field(default_factory=dict)
    _boxing: dict[tuple[int, int, int], tuple[BoxingStep, pp.Boxing]] = field(default_factory=dict)
    _p2ps: dict[int, _P2P] = field(default_factory=dict)
    _visits: dict[int, list[int]] = field(default_factory=dict)  # step -> destinations touching built ranks
    trail: list[tuple[str, BoxingPlan, int]] | None = None  # every boxing step emitted, in order

    # ---- primitives ---------------------------------------------------------------------------

    def each(self, pl: Placement, tasks: int, registers: int) -> Iterator[tuple[tuple[int, ...], int]]:
        """(coordinate, rank) of each built rank of ``pl`` in row-major order, with the id counters where
        the full plan has them for that rank (each rank emits ``tasks`` tasks and ``registers`` registers);
        after the loop, the counters are past every rank of ``pl``."""
        coords = _coords(pl)
        chosen = self._chosen.get(pl)
        if chosen is None:
            keep = self.keep
            chosen = (
                list(range(len(coords))) if keep is None else [i for i, r in enumerate(pl.ranks) if r in keep]
            )
            self._chosen[pl] = chosen
        t0, r0 = self.next_task, self.next_reg
        for i in chosen:
            self.next_task, self.next_reg = t0 + i * tasks, r0 + i * registers
            yield coords[i], pl.ranks[i]
        self.next_task, self.next_reg = t0 + len(coords) * tasks, r0 + len(coords) * registers

    def task(self, rank: int, kind: int, op_name: str = "", stage: int = 0) -> pp.Task | None:
        """A new task on ``rank``; ``None`` (its id counted) when that rank is not built."""
        tid = self.next_task
        self.next_task += 1
        device = self.devices.get(rank)
        if device is None:
            return None
        return device.tasks.add(
            id=tid, kind=kind, stream=STREAM[kind], op_name=op_name, stage=stage, micro_batch=self.micro_batch
        )  # type: ignore[arg-type]

    def produce(
        self,
        task: pp.Task | None,
        rank: int,
        shape: Sequence[int],
        dtype: DType,
        tensor: str = "",
        hold: bool = True,
    ) -> int:
        rid = self.next_reg
        self.next_reg += 1
        if task is None:
            return -1
        reg = self.devices[rank].registers.add(
            id=rid,
            producer_task=task.id,
            count=REGISTER_COUNT.get(task.kind, 1),
            bytes=prod(shape) * dtype.itemsize,
            shape=shape,
            dtype=wire.dtype_to_proto(dtype),
            tensor=tensor,
        )  # type: ignore[arg-type]
        task.out_registers.append(rid)
        self.registers[rid] = reg
        if tensor and hold:
            self.held[(tensor, rank, self.micro_batch)] = rid
        return rid

    def read(self, task: pp.Task | None, register: int) -> None:
        if task is not None:
            task.in_registers.append(register)
            self.registers[register].consumer_tasks.append(task.id)

    def holder(self, tensor: str, rank: int, who: str) -> int:
        """This micro-batch's register of ``tensor`` on ``rank``, else the per-step one."""
        reg = self.held.get((tensor, rank, self.micro_batch))
        reg = self.held.get((tensor, rank, -1)) if reg is None else reg
        if reg is None:
            decl = self.graph.tensors[tensor]
            raise LoweringError(
                f"{who} on rank {rank} reads {decl!r}, which rank {rank} does not hold; the boxing pass must "
                "move it onto the op's placement first"
            )
        return reg

    def produce_shard(
        self, task: pp.Task | None, rank: int, decl: TensorDecl, coord: tuple[int, ...], hold: bool = True
    ) -> int:
        assert decl.placement is not None and decl.sbp is not None
        shape = shard_shape(decl.meta.shape, decl.placement.shape, decl.sbp, coord)
        return self.produce(task, rank, shape, decl.meta.dtype, decl.name, hold)

    # ---- tensors that enter the step, ops, tensors that leave it ----------------------------

    def emit_source(self, decl: TensorDecl, kind: int) -> None:
        assert decl.placement is not None
        for coord, rank in self.each(decl.placement, 1, 1):
            self.produce_shard(self.task(rank, kind, decl.name), rank, decl, coord)

    def emit_op(self, op: OpNode, state: CompileState) -> None:
        if op.op_type == BOXING:
            self.emit_boxing(op, state.boxings.get(op.name) or plan_of(self.graph, op))
        else:
            self.emit_kernel(op)

    def emit_accumulate(self, tensor: str, k: int, m: int, stage: int) -> None:
        """Micro-batch ``k``'s share of the running mean of ``tensor`` over ``m`` micro-batches: a running
        sum in one buffer (``((g0 + g1) + g2) + g3``, the reference's order), divided by ``m`` at the last;
        the last one's register is the per-step value everything after the micro-batches reads."""
        decl = self.graph.tensors[tensor]
        assert decl.placement is not None
        for coord, rank in self.each(decl.placement, 1, 1):
            t = self.task(rank, K.TASK_KIND_ACCUMULATE, f"accumulate/{tensor}", stage)
            assert t is not None
            t.attrs["tensor"].CopyFrom(wire.attr_to_proto(tensor))
            t.attrs["first"].CopyFrom(wire.attr_to_proto(k == 0))
            t.attrs["divide_by"].CopyFrom(wire.attr_to_proto(m if k == m - 1 else 1))
            if k > 0:
                self.read(t, self.held[(tensor, rank, -2)])  # the running sum so far
            self.read(t, self.holder(tensor, rank, f"accumulation of {tensor!r}"))
            reg = self.produce_shard(t, rank, decl, coord, hold=False)
            self.held[(tensor, rank, -1 if k == m - 1 else -2)] = reg

    def emit_kernel(self, op: OpNode) -> None:
        where = _placement_of(self.graph, op)
        kind = K.TASK_KIND_OPTIMIZER if op.op_type in OPTIMIZER_OPS else K.TASK_KIND_KERNEL
        outs = [self.graph.tensors[o] for o in op.outputs]
        for o in outs:
            if o.placement != where:
                raise LoweringError(
                    f"op {op.name!r} ({op.op_type}) runs on {where} but writes {o!r}; an op writes on its placement"
                )
        for coord, rank in self.each(where, 1, len(outs)):
            t = self.task(rank, kind, op.name, op.stage)
            assert t is not None
            t.op_type = op.op_type
            attrs = self._attrs.get(op.name)
            if attrs is None:  # once per op, not per (rank, micro-batch)
                attrs = self._attrs[op.name] = [(k, wire.attr_to_proto(v)) for k, v in op.attrs.items()]
            for k, v in attrs:
                t.attrs[k].CopyFrom(v)  # type: ignore[arg-type]
            for i in op.inputs:
                self.read(t, self.holder(i, rank, f"op {op.name!r} ({op.op_type})"))
            for o in outs:
                self.produce_shard(t, rank, o, coord)

    def emit_assign(self, var: str, new: str) -> None:
        v, n = self.graph.tensors[var], self.graph.tensors[new]
        if (v.placement, v.sbp) != (n.placement, n.sbp):
            raise LoweringError(
                f"the update of {v!r} is {n!r}: the new value must have the variable's placement and SBP; "
                "box it before the assignment"
            )
        self._sinks(var, new, "assign", var)

    def emit_fetch(self, name: str) -> None:
        self._sinks(name, name, "fetch", name)

    def _sinks(self, op_name: str, tensor: str, attr: str, value: str) -> None:
        where = self.graph.tensors[tensor].placement
        assert where is not None
        for _, rank in self.each(where, 1, 0):
            t = self.task(rank, K.TASK_KIND_SINK, op_name)
            assert t is not None
            t.attrs[attr].CopyFrom(wire.attr_to_proto(value))
            self.read(t, self.holder(tensor, rank, f"{attr} of {op_name!r}"))

    # ---- boxing -------------------------------------------------------------------------------

    def emit_boxing(self, op: OpNode, plan: BoxingPlan) -> None:
        src, dst = (self.graph.tensors[op.inputs[0]], self.graph.tensors[op.outputs[0]])
        if (plan.src, plan.src_sbp, plan.dst, plan.dst_sbp) != (
            src.placement,
            src.sbp,
            dst.placement,
            dst.sbp,
        ):
            raise LoweringError(
                f"boxing op {op.name!r}: its plan {plan!r} does not map {src!r} to {dst!r}; re-plan it"
            )
        cur = {r: self.holder(src.name, r, f"boxing op {op.name!r}") for r in self.built(plan.src)}
        if plan.is_identity:  # a no-op boxing still needs the output register: a local copy
            step = BoxingStep(Collective.local_slice, 0, plan.src_sbp, plan.dst_sbp, 0)
            self._collective(op, plan, step, cur, dst.name)
            return
        for i, step in enumerate(plan.steps):
            if self.trail is not None:
                self.trail.append((op.name, plan, i))
            name = dst.name if i == len(plan.steps) - 1 else ""
            if step.collective is Collective.p2p:
                cur = self._p2p(op, plan, step, cur, name)
            else:
                cur = self._collective(op, plan, step, cur, name)

    def built(self, pl: Placement) -> list[int]:
        return list(pl.ranks) if self.keep is None else [r for r in pl.ranks if r in self.devices]

    def _boxing_task(
        self, rank: int, op: OpNode, kind: int, step: BoxingStep, collective: int, nbytes: int
    ) -> pp.Task | None:
        t = self.task(rank, kind, op.name, op.stage)
        if t is not None:
            key = (id(step), collective, nbytes)  # the step is kept alive beside its proto: ids stay unique
            if key not in self._boxing:
                proto = pp.Boxing(
                    from_sbp=format_nd(step.from_sbp),
                    to_sbp=format_nd(step.to_sbp),
                    collective=collective,  # type: ignore[arg-type]
                    bytes_moved=nbytes,
                )
                self._boxing[key] = (step, proto)
            t.boxing.CopyFrom(self._boxing[key][1])
        return t

    def _collective(
        self, op: OpNode, plan: BoxingPlan, step: BoxingStep, cur: dict[int, int], name: str
    ) -> dict[int, int]:
        pl, meta, kind = plan.src, plan.meta, COLLECTIVE[step.collective]
        out, tasks = {}, {}
        for coord, rank in self.each(pl, 1, 1):
            t = self._boxing_task(rank, op, K.TASK_KIND_BOXING, step, kind, step.bytes)
            self.read(t, cur.get(rank, -1))
            shape = shard_shape(meta.shape, pl.shape, step.to_sbp, coord)
            out[rank] = self.produce(t, rank, shape, meta.dtype, name)
            tasks[coord] = t
        if step.collective not in LOCAL:
            assert step.mesh_axis is not None
            call = Call(op.name, _boxing_name(step), call_kind(kind), step.bytes)
            for group in self.groups(pl, step.mesh_axis):
                members = [
                    (
                        tasks.get(c),
                        pl.rank_at(c),
                        kind,
                        rank_send_bytes(step, plan, c) if tasks.get(c) is not None else 0,
                    )
                    for c in group
                ]
                self.comm.add(pl.device_type, [pl.rank_at(c) for c in group], call, members)
        return out

    def groups(self, pl: Placement, axis: int) -> list[list[tuple[int, ...]]]:
        """The groups along ``axis`` with a built rank (every group when the calls are logged)."""
        key = (pl, axis)
        if key not in self._groups:
            every = _groups(pl, axis)
            if self.keep is not None:  # the other groups' communicators have no built rank
                every = [g for g in every if any(pl.rank_at(c) in self.keep for c in g)]
            self._groups[key] = every
        return self._groups[key]

    def _p2p(
        self, op: OpNode, plan: BoxingPlan, step: BoxingStep, cur: dict[int, int], name: str
    ) -> dict[int, int]:
        lay = self._p2ps.get(id(step))
        if lay is None:
            lay = self._p2ps[id(step)] = _p2p_layout(plan, step)
        visits = self._visits.get(id(step))
        if visits is None:  # the destinations a built rank takes part in; the others are only counted
            keep = self.keep
            visits = (
                list(range(len(lay.dests)))
                if keep is None
                else sorted({i for r in keep for i in lay.touching.get(r, ())})
            )
            self._visits[id(step)] = visits
        t0, r0 = self.next_task, self.next_reg
        out = {}
        built, every = self.devices, self.keep is None
        for i in visits:
            dest, d = lay.dests[i], lay.dests[i].rank
            self.next_task, self.next_reg = t0 + lay.starts[i][0], r0 + lay.starts[i][1]
            pieces = []
            for s, nbytes, shape in dest.sources:
                if s == d:
                    pieces.append(cur.get(d, -1))
                elif every or s in built or d in built:
                    pieces.append(self._send_recv(op, plan, step, cur.get(s, -1), s, d, nbytes, shape))
                else:  # a transfer between two ranks not built: its send, its receive and its piece counted
                    self.next_task, self.next_reg = self.next_task + 2, self.next_reg + 1
                    pieces.append(-1)
            if dest.whole:  # the one received piece is the shard: name its register
                if d in self.devices:
                    reg = self.registers[pieces[0]]
                    reg.tensor = name
                    out[d] = reg.id
                    if name:
                        self.held[(name, d, self.micro_batch)] = reg.id
                continue
            collective = Collective.local_slice if pieces else Collective.zero_fill
            t = self._boxing_task(d, op, K.TASK_KIND_BOXING, step, COLLECTIVE[collective], 0)
            for p in pieces:
                self.read(t, p)
            rid = self.produce(t, d, dest.want, plan.meta.dtype, name)
            if t is not None:
                out[d] = rid
        self.next_task, self.next_reg = t0 + lay.total[0], r0 + lay.total[1]
        return out

    def _send_recv(
        self,
        op: OpNode,
        plan: BoxingPlan,
        step: BoxingStep,
        source: int,
        s: int,
        d: int,
        nbytes: int,
        shape: tuple[int, ...],
    ) -> int:
        send = self._boxing_task(s, op, K.TASK_KIND_SEND, step, pp.COLLECTIVE_KIND_SEND, nbytes)
        self.read(send, source)
        recv = self._boxing_task(d, op, K.TASK_KIND_RECV, step, pp.COLLECTIVE_KIND_RECV, nbytes)
        piece = self.produce(recv, d, shape, plan.meta.dtype)
        call = Call(op.name, _boxing_name(step), call_kind(pp.COLLECTIVE_KIND_SEND), nbytes)
        self.comm.add(
            plan.src.device_type,
            pair_ranks(s, d),
            call,
            [(send, s, pp.COLLECTIVE_KIND_SEND, nbytes), (recv, d, pp.COLLECTIVE_KIND_RECV, 0)],
        )
        return piece


def _boxing_name(step: BoxingStep) -> str:
    return f"{format_nd(step.from_sbp)} -> {format_nd(step.to_sbp)}"


def _groups(pl: Placement, axis: int) -> list[list[tuple[int, ...]]]:
    """The coordinates of each group of ranks along mesh ``axis`` (one group per setting of the others)."""
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for c in pl.coords():
        groups.setdefault(c[:axis] + c[axis + 1 :], []).append(c)
    return list(groups.values())


def rank_send_bytes(step: BoxingStep, plan: BoxingPlan, coord: Sequence[int]) -> int:
    """Bytes the rank at ``coord`` sends in a group collective; summed over all ranks it is ``step.bytes``.

    All-reduce is counted as ring reduce-scatter + all-gather over the flat buffer; the others send
    exactly the part of their shard that another rank of the group needs.
    """
    assert step.mesh_axis is not None
    k, meta, pl = step.mesh_axis, plan.meta, plan.src
    group_sbp = tuple(B if i == k else s for i, s in enumerate(step.from_sbp))
    region = [s.stop - s.start for s in shard_index(meta.shape, pl.shape, group_sbp, coord)]
    p, me, n = pl.shape[k], coord[k], prod(region)

    def part(axis: int) -> int:  # elements of the region in my slice along ``axis``
        lo, hi = split_range(region[axis], p, me)
        return (hi - lo) * (n // region[axis]) if region[axis] else 0

    src, dst = step.from_sbp[k], step.to_sbp[k]
    table = {
        Collective.all_reduce: lambda: n + (p - 2) * (split_range(n, p, me)[1] - split_range(n, p, me)[0]),
        Collective.reduce_scatter: lambda: n - part(dst.axis),  # type: ignore[union-attr]
        Collective.all_gather: lambda: (p - 1) * part(src.axis),  # type: ignore[union-attr]
        Collective.all_to_all: lambda: _all_to_all_send(region, p, me, src.axis, dst.axis),  # type: ignore[union-attr]
    }
    return table[step.collective]() * meta.dtype.itemsize if step.collective in table else 0


def _all_to_all_send(region: list[int], p: int, me: int, i: int, j: int) -> int:
    ni, nj = region[i], region[j]
    rest = prod(region) // (ni * nj) if ni * nj else 0
    mine_i = split_range(ni, p, me)[1] - split_range(ni, p, me)[0]
    mine_j = split_range(nj, p, me)[1] - split_range(nj, p, me)[0]
    return mine_i * (nj - mine_j) * rest
