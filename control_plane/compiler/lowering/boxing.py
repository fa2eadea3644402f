"""Lowering's boxing emission: each step of a boxing plan becomes tasks on its ranks and calls on communicators.

A boxing plan with several steps becomes one task per step per rank (the planner's steps are each one
group collective; a task per step lets the runtime execute exactly one primitive per actor and lets
the communicator order name each collective). Between placements, each (source, destination) pair with
a transfer is a SEND on the source and a RECV on the destination, on the pair's communicator; a
destination that needs more than that one piece (its own copy, several sources) assembles them in a
BOXING task marked ``local slice``, and a destination that only holds zeros (P) gets a ``zero fill``.
Each boxing task carries its step as data (``Task.boxing``: the step's position, nd-SBPs, mesh axis and
group, or the transfers it takes part in with the regions of its shards), so the runtime executes it
from the plan alone and never re-plans.

Every call on a communicator is recorded in :class:`CommOrder` at its position in the one global walk;
a walk that builds only some ranks still visits every group and destination that involves one of them,
so their positions are exact, and only counts the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod

from sbpflow.boxing import BoxingPlan, BoxingStep, Collective, Transfer, plan_boxing
from sbpflow.control_plane.compiler.comm_order import Call, CommOrder, call_kind, pair_ranks
from sbpflow.control_plane.compiler.lowering.tasks import (
    STREAM,
    K,
    LoweringError,
    TaskEmitter,
    placement_of,
    rank_coords,
    shard_shape,
)
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, Graph, OpNode
from sbpflow.placement import Placement
from sbpflow.sbp import B, NdSbp, format_nd
from sbpflow.sharding import Index, shard_index, split_range
from sbpflow.v1 import job_pb2 as jp
from sbpflow.v1 import plan_pb2 as pp

COLLECTIVE = {
    Collective.all_reduce: pp.COLLECTIVE_KIND_ALL_REDUCE,
    Collective.reduce_scatter: pp.COLLECTIVE_KIND_REDUCE_SCATTER,
    Collective.all_gather: pp.COLLECTIVE_KIND_ALL_GATHER,
    Collective.all_to_all: pp.COLLECTIVE_KIND_ALL_TO_ALL,
    Collective.local_slice: pp.COLLECTIVE_KIND_LOCAL_SLICE,
    Collective.zero_fill: pp.COLLECTIVE_KIND_ZERO_FILL,
}
LOCAL = {Collective.local_slice, Collective.zero_fill}


def plan_of(g: Graph, op: OpNode) -> BoxingPlan:
    src, dst = g.tensors[op.inputs[0]], g.tensors[op.outputs[0]]
    assert src.placement and src.sbp is not None and dst.placement and dst.sbp is not None
    return plan_boxing(src.meta, src.placement, src.sbp, dst.placement, dst.sbp)


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
    by_dst: dict[int, dict[int, list[Transfer]]]  # destination -> source -> its transfers, in order


def p2p_layout(plan: BoxingPlan, step: BoxingStep) -> _P2P:
    meta, dst = plan.meta, plan.dst
    by_dst: dict[int, dict[int, list[Transfer]]] = {}
    for tr in step.transfers:
        by_dst.setdefault(tr.dst, {}).setdefault(tr.src, []).append(tr)
    dests: list[_Dest] = []
    starts: list[tuple[int, int]] = []
    touching: dict[int, list[int]] = {}
    tasks = registers = 0
    for coord in rank_coords(dst):
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
    return _P2P(step, dests, starts, (tasks, registers), touching, by_dst)


@dataclass
class Memo:
    """What a walk works out that does not depend on the ranks it builds: kept across the walks of one
    compiled state (``Compiled.rank_plans`` lowers a big job in many), so each is worked out once."""

    attrs: dict[str, list[tuple[str, object]]] = field(default_factory=dict)  # op -> its attrs as protos
    sbps: dict[NdSbp, jp.NdSbp] = field(default_factory=dict)
    boxing: dict[tuple[int, int, int, int], tuple[BoxingStep, pp.Boxing]] = field(default_factory=dict)
    p2ps: dict[int, _P2P] = field(default_factory=dict)  # id(step) -> its layout (which keeps it alive)
    group_of: dict[tuple[Placement, int], dict[tuple[int, ...], list[int]]] = field(default_factory=dict)
    transfers: dict[int, tuple[list[Transfer], list[pp.Transfer]]] = field(
        default_factory=dict
    )  # by id(list)
    src_regions: dict[tuple[int, int], pp.Region] = field(default_factory=dict)  # (id(step), rank) -> region
    copies: dict[tuple[NdSbp, NdSbp], BoxingStep] = field(default_factory=dict)  # an identity boxing's step

    def transfer_protos(self, trs: list[Transfer]) -> list[pp.Transfer]:
        """The protos of a pair's transfers (a list a cached p2p layout holds, so ``id`` names it)."""
        got = self.transfers.get(id(trs))
        if got is None:
            got = self.transfers[id(trs)] = (trs, [transfer_proto(tr) for tr in trs])
        return got[1]


@dataclass
class Lowerer(TaskEmitter):
    """One walk of the lowering: :class:`TaskEmitter` plus the boxing steps and the communicator order."""

    comm: CommOrder = field(default_factory=CommOrder)
    memo: Memo = field(default_factory=Memo)
    _groups: dict[tuple[Placement, int], list[list[tuple[int, ...]]]] = field(default_factory=dict)
    _visits: dict[int, list[int]] = field(default_factory=dict)  # step -> destinations touching built ranks
    _spans: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # op -> ``span``
    _emission: tuple[str, int] = ("", 0)  # the (op, micro-batch) whose boxing task protos ``_protos`` holds
    _protos: dict[tuple[int, int, int, int, int], pp.Task] = field(default_factory=dict)
    trail: list[tuple[str, BoxingPlan, int]] | None = None  # every boxing step emitted, in order

    def __post_init__(self) -> None:
        self._attrs, self._sbps = self.memo.attrs, self.memo.sbps
        self._boxing, self._p2ps, self._group_of = self.memo.boxing, self.memo.p2ps, self.memo.group_of

    def emit_op(self, op: OpNode, state: CompileState) -> None:
        if self.budget is not None:  # a walk grows with ops x micro-batches, built or only counted
            self.budget.made(steps=1)
        if self.keep is not None and self.trail is None:  # a partial walk: skip what no built rank is in
            if op.name not in self._spans:
                self._spans[op.name] = self.span(op, state)
            span = self._spans[op.name]
            if span is not None:
                self.seek(self.next_task + span[0], self.next_reg + span[1])
                return
        if op.op_type == BOXING:
            self.emit_boxing(op, state.boxings.get(op.name) or plan_of(self.graph, op))
        else:
            self.emit_kernel(op)

    def span(self, op: OpNode, state: CompileState) -> tuple[int, int] | None:
        """The (tasks, registers) ``op`` emits over every rank when none of its ranks is built, else
        ``None``: a walk that builds none of them only counts them (no task, register or communicator
        call of a built rank is among them). The op's checks run in the walks that build its ranks."""
        assert self.keep is not None
        keep = self.keep
        if op.op_type != BOXING:
            where = placement_of(self.graph, op)
            if not keep.isdisjoint(where.ranks):
                return None
            return where.size, where.size * len(op.outputs)
        plan = state.boxings.get(op.name) or plan_of(self.graph, op)
        if not (keep.isdisjoint(plan.src.ranks) and keep.isdisjoint(plan.dst.ranks)):
            return None
        if plan.is_identity:
            return plan.src.size, plan.src.size
        tasks = registers = 0
        for step in plan.steps:
            if step.collective is Collective.p2p:
                lay = self._p2ps.get(id(step))
                if lay is None:
                    lay = self._p2ps[id(step)] = p2p_layout(plan, step)
                tasks, registers = tasks + lay.total[0], registers + lay.total[1]
            else:
                tasks, registers = tasks + plan.src.size, registers + plan.src.size
        return tasks, registers

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
            step = self.memo.copies.setdefault((plan.src_sbp, plan.dst_sbp), step)  # one object: a key by id
            self.collective(op, plan, step, cur, dst.name, 0)
            return
        for i, step in enumerate(plan.steps):
            if self.trail is not None:
                self.trail.append((op.name, plan, i))
            name = dst.name if i == len(plan.steps) - 1 else ""
            if step.collective is Collective.p2p:
                cur = self.p2p(op, plan, step, cur, name, i)
            else:
                cur = self.collective(op, plan, step, cur, name, i)

    def built(self, pl: Placement) -> list[int]:
        return list(pl.ranks) if self.keep is None else [r for r in pl.ranks if r in self.devices]

    def _boxing_task(
        self,
        rank: int,
        op: OpNode,
        kind: int,
        step: BoxingStep,
        collective: int,
        nbytes: int,
        index: int,
        coord: Sequence[int],
    ) -> pp.Task | None:
        """A task of step ``index`` of a boxing, with the part of its ``Task.boxing`` every rank shares;
        the caller adds this rank's group, transfers and regions."""
        if rank not in self.devices:
            self.next_task += 1
            return None
        if self._emission != (op.name, self.micro_batch):  # the protos of one emission's tasks
            self._emission = (op.name, self.micro_batch)
            self._protos.clear()
        key = (id(step), collective, nbytes, index)  # the step is kept alive beside its proto
        task = self._protos.get((kind, *key))
        if task is None:
            if key not in self._boxing:
                proto = pp.Boxing(
                    from_sbp=format_nd(step.from_sbp),
                    to_sbp=format_nd(step.to_sbp),
                    collective=collective,  # type: ignore[arg-type]
                    bytes_moved=nbytes,
                    step=index,
                    from_nd_sbp=self.sbp_proto(step.from_sbp),
                    to_nd_sbp=self.sbp_proto(step.to_sbp),
                    point_to_point=step.collective is Collective.p2p,
                    mesh_axis=step.mesh_axis or 0,
                )
                self._boxing[key] = (step, proto)
            task = pp.Task(kind=kind, stream=STREAM[kind], op_name=op.name, stage=op.stage)  # type: ignore[arg-type]
            task.micro_batch = self.micro_batch
            task.boxing.CopyFrom(self._boxing[key][1])
            self._protos[(kind, *key)] = task
        return self.like(rank, task, coord)

    def group_of(self, pl: Placement, axis: int, coord: tuple[int, ...]) -> list[int]:
        """The ranks of the group along mesh ``axis`` through ``coord``, in mesh order."""
        key = (pl, axis)
        if key not in self._group_of:
            self._group_of[key] = {
                c: ranks for g in _groups(pl, axis) for ranks in [[pl.rank_at(x) for x in g]] for c in g
            }
        return self._group_of[key][coord]

    def collective(
        self, op: OpNode, plan: BoxingPlan, step: BoxingStep, cur: dict[int, int], name: str, index: int
    ) -> dict[int, int]:
        pl, meta, kind = plan.src, plan.meta, COLLECTIVE[step.collective]
        out, tasks = {}, {}
        for coord, rank in self.each(pl, 1, 1):
            t = self._boxing_task(rank, op, K.TASK_KIND_BOXING, step, kind, step.bytes, index, coord)
            if t is not None and step.mesh_axis is not None:
                t.boxing.group.extend(self.group_of(pl, step.mesh_axis, coord))
            self.read(t, cur.get(rank, -1))
            shape = shard_shape(meta.shape, pl.shape, step.to_sbp, coord)
            out[rank] = self.produce(t, rank, shape, meta.dtype, name, sbp=step.to_sbp)
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

    def p2p(
        self, op: OpNode, plan: BoxingPlan, step: BoxingStep, cur: dict[int, int], name: str, index: int
    ) -> dict[int, int]:
        lay = self._p2ps.get(id(step))
        if lay is None:
            lay = self._p2ps[id(step)] = p2p_layout(plan, step)
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
            self.seek(t0 + lay.starts[i][0], r0 + lay.starts[i][1])
            pieces = []
            for s, nbytes, shape in dest.sources:
                if s == d:
                    pieces.append(cur.get(d, -1))
                elif every or s in built or d in built:
                    trs = lay.by_dst[d][s]
                    pieces.append(
                        self._send_recv(op, plan, (step, index, trs), cur.get(s, -1), dest, nbytes, shape)
                    )
                else:  # a transfer between two ranks not built: its send, its receive and its piece counted
                    self.seek(self.next_task + 2, self.next_reg + 1)
                    pieces.append(-1)
            if dest.whole:  # the one received piece is the shard: name its register
                if d in self.devices:
                    reg = self.registers[pieces[0]]
                    reg.tensor = name
                    reg.sbp.CopyFrom(self.sbp_proto(step.to_sbp))
                    out[d] = reg.id
                    if name:
                        self.held[(name, d, self.micro_batch)] = reg.id
                continue
            collective = Collective.local_slice if pieces else Collective.zero_fill
            t = self._boxing_task(
                d, op, K.TASK_KIND_BOXING, step, COLLECTIVE[collective], 0, index, dest.coord
            )
            if t is not None:
                _assembly_data(t.boxing, plan, step, dest, lay.by_dst.get(d, {}))
            for p in pieces:
                self.read(t, p)
            rid = self.produce(t, d, dest.want, plan.meta.dtype, name, sbp=step.to_sbp)
            if t is not None:
                out[d] = rid
        self.seek(t0 + lay.total[0], r0 + lay.total[1])
        return out

    def _send_recv(
        self,
        op: OpNode,
        plan: BoxingPlan,
        what: tuple[BoxingStep, int, list[Transfer]],  # the step, its position, the pair's transfers
        source: int,
        dest: _Dest,
        nbytes: int,
        shape: tuple[int, ...],
    ) -> int:
        step, index, trs = what
        s, d = trs[0].src, dest.rank
        src_coord = plan.src.coord_of(s)
        send = self._boxing_task(
            s, op, K.TASK_KIND_SEND, step, pp.COLLECTIVE_KIND_SEND, nbytes, index, src_coord
        )
        if send is not None:
            send.boxing.peer = d
            send.boxing.transfers.extend(self.memo.transfer_protos(trs))
            region = self.memo.src_regions.get((id(step), s))
            if region is None:
                src_index = shard_index(plan.meta.shape, plan.src.shape, step.from_sbp, src_coord)
                region = self.memo.src_regions[(id(step), s)] = region_proto(src_index)
            send.boxing.src_region.CopyFrom(region)
        self.read(send, source)
        recv = self._boxing_task(
            d, op, K.TASK_KIND_RECV, step, pp.COLLECTIVE_KIND_RECV, nbytes, index, dest.coord
        )
        if recv is not None:
            recv.boxing.peer = s
            recv.boxing.transfers.extend(self.memo.transfer_protos(trs))
        piece = self.produce(recv, d, shape, plan.meta.dtype)
        call = Call(op.name, _boxing_name(step), call_kind(pp.COLLECTIVE_KIND_SEND), nbytes)
        self.comm.add(
            plan.src.device_type,
            pair_ranks(s, d),
            call,
            [(send, s, pp.COLLECTIVE_KIND_SEND, nbytes), (recv, d, pp.COLLECTIVE_KIND_RECV, 0)],
        )
        return piece


def region_proto(index: Index) -> pp.Region:
    return pp.Region(start=[s.start for s in index], stop=[s.stop for s in index])


def transfer_proto(tr: Transfer) -> pp.Transfer:
    return pp.Transfer(src=tr.src, dst=tr.dst, region=region_proto(tr.region))


def _assembly_data(
    m: pp.Boxing, plan: BoxingPlan, step: BoxingStep, dest: _Dest, by_src: dict[int, list[Transfer]]
) -> None:
    """What a destination's assembly reads: every transfer to it (by source, in order), its shard's
    region, and its own source shard's region when it holds one."""
    m.transfers.extend(transfer_proto(tr) for trs in by_src.values() for tr in trs)
    m.dst_region.CopyFrom(region_proto(shard_index(plan.meta.shape, plan.dst.shape, step.to_sbp, dest.coord)))
    if dest.rank in plan.src.ranks:
        own = shard_index(plan.meta.shape, plan.src.shape, step.from_sbp, plan.src.coord_of(dest.rank))
        m.src_region.CopyFrom(region_proto(own))


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
