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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from math import prod

from sbpflow import wire
from sbpflow.control_plane.compiler import micro_batching
from sbpflow.control_plane.compiler.boxing import BoxingPlan, BoxingStep, Collective, Transfer, plan_boxing
from sbpflow.control_plane.compiler.comm_order import CommOrder, pair_ranks
from sbpflow.control_plane.compiler.micro_batching import Layout
from sbpflow.control_plane.compiler.schedule import Phase
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.dtype import DType
from sbpflow.errors import SbpflowError
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.placement import Placement
from sbpflow.sbp import B, format_nd
from sbpflow.sharding import local_shape, shard_index, split_range
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


def run(state: CompileState, job_id: str = "") -> pp.Plan:
    """The physical plan of ``state.graph``; ``state`` is not changed."""
    g = state.graph
    _require_layout(g)
    lay = micro_batching.layout(state)
    low = _Lowerer(g, _devices(g))
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
    return pp.Plan(
        format_version=PLAN_FORMAT_VERSION,
        job_id=job_id,
        devices=[low.devices[r] for r in sorted(low.devices)],
        communicators=low.comm.to_proto(),
        job=wire.job_to_proto(dataclasses.replace(state.job, graph=g)),
    )


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
    for t in g.tensors.values():
        assert t.placement is not None
        for r in t.placement.ranks:
            if kinds.setdefault(r, t.placement.device_type) != t.placement.device_type:
                raise LoweringError(
                    f"rank {r} is {kinds[r]} for one tensor and {t.placement.device_type} for {t.name!r}; "
                    "a rank is one device: use distinct ranks for cpu and cuda placements"
                )
    device = {d: wire.placement_to_proto(Placement(d, (0,), (1,))).device_type for d in set(kinds.values())}
    return {r: pp.DevicePlan(rank=r, device_type=device[d]) for r, d in sorted(kinds.items())}


def _plan_of(g: Graph, op: OpNode) -> BoxingPlan:
    src, dst = g.tensors[op.inputs[0]], g.tensors[op.outputs[0]]
    assert src.placement and src.sbp is not None and dst.placement and dst.sbp is not None
    return plan_boxing(src.meta, src.placement, src.sbp, dst.placement, dst.sbp)


def _placement_of(g: Graph, op: OpNode) -> Placement:
    where = op.placement or g.tensors[op.outputs[0]].placement
    assert where is not None
    return where


@dataclass
class _Lowerer:
    graph: Graph
    devices: dict[int, pp.DevicePlan]
    comm: CommOrder = field(default_factory=CommOrder)
    held: dict[tuple[str, int, int], int] = field(
        default_factory=dict
    )  # (tensor, rank, micro-batch) -> register
    micro_batch: int = -1  # of the tasks being emitted; -1 = once per step
    registers: dict[int, pp.RegisterDesc] = field(default_factory=dict)
    task_ids: count = field(default_factory=count)
    register_ids: count = field(default_factory=count)

    # ---- primitives ---------------------------------------------------------------------------

    def task(self, rank: int, kind: int, op_name: str = "", stage: int = 0) -> pp.Task:
        return self.devices[rank].tasks.add(
            id=next(self.task_ids),
            kind=kind,
            stream=STREAM[kind],
            op_name=op_name,
            stage=stage,
            micro_batch=self.micro_batch,
        )  # type: ignore[arg-type]

    def produce(
        self,
        task: pp.Task,
        rank: int,
        shape: Sequence[int],
        dtype: DType,
        tensor: str = "",
        hold: bool = True,
    ) -> int:
        reg = self.devices[rank].registers.add(
            id=next(self.register_ids),
            producer_task=task.id,
            count=REGISTER_COUNT.get(task.kind, 1),
            bytes=prod(shape) * dtype.itemsize,
            shape=shape,
            dtype=wire.dtype_to_proto(dtype),
            tensor=tensor,
        )  # type: ignore[arg-type]
        task.out_registers.append(reg.id)
        self.registers[reg.id] = reg
        if tensor and hold:
            self.held[(tensor, rank, self.micro_batch)] = reg.id
        return reg.id

    def read(self, task: pp.Task, register: int) -> None:
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
        self, task: pp.Task, rank: int, decl: TensorDecl, coord: Sequence[int], hold: bool = True
    ) -> int:
        assert decl.placement is not None and decl.sbp is not None
        shape = local_shape(decl.meta.shape, decl.placement.shape, decl.sbp, coord)
        return self.produce(task, rank, shape, decl.meta.dtype, decl.name, hold)

    # ---- tensors that enter the step, ops, tensors that leave it ----------------------------

    def emit_source(self, decl: TensorDecl, kind: int) -> None:
        assert decl.placement is not None
        for coord in decl.placement.coords():
            rank = decl.placement.rank_at(coord)
            self.produce_shard(self.task(rank, kind, decl.name), rank, decl, coord)

    def emit_op(self, op: OpNode, state: CompileState) -> None:
        if op.op_type == BOXING:
            self.emit_boxing(op, state.boxings.get(op.name) or _plan_of(self.graph, op))
        else:
            self.emit_kernel(op)

    def emit_accumulate(self, tensor: str, k: int, m: int, stage: int) -> None:
        """Micro-batch ``k``'s share of the running mean of ``tensor`` over ``m`` micro-batches: a running
        sum in one buffer (``((g0 + g1) + g2) + g3``, the reference's order), divided by ``m`` at the last;
        the last one's register is the per-step value everything after the micro-batches reads."""
        decl = self.graph.tensors[tensor]
        assert decl.placement is not None
        for coord in decl.placement.coords():
            rank = decl.placement.rank_at(coord)
            t = self.task(rank, K.TASK_KIND_ACCUMULATE, f"accumulate/{tensor}", stage)
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
        for coord in where.coords():
            rank = where.rank_at(coord)
            t = self.task(rank, kind, op.name, op.stage)
            t.op_type = op.op_type
            for k, v in op.attrs.items():
                t.attrs[k].CopyFrom(wire.attr_to_proto(v))
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
        for rank in where.ranks:
            t = self.task(rank, K.TASK_KIND_SINK, op_name)
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
        cur = {r: self.holder(src.name, r, f"boxing op {op.name!r}") for r in plan.src.ranks}
        if plan.is_identity:  # a no-op boxing still needs the output register: a local copy
            step = BoxingStep(Collective.local_slice, 0, plan.src_sbp, plan.dst_sbp, 0)
            self._collective(op, plan, step, cur, dst.name)
            return
        for i, step in enumerate(plan.steps):
            name = dst.name if i == len(plan.steps) - 1 else ""
            if step.collective is Collective.p2p:
                cur = self._p2p(op, plan, step, cur, name)
            else:
                cur = self._collective(op, plan, step, cur, name)

    def _boxing_task(
        self, rank: int, op: OpNode, kind: int, step: BoxingStep, collective: int, nbytes: int
    ) -> pp.Task:
        t = self.task(rank, kind, op.name, op.stage)
        t.boxing.CopyFrom(
            pp.Boxing(
                from_sbp=format_nd(step.from_sbp),
                to_sbp=format_nd(step.to_sbp),
                collective=collective,  # type: ignore[arg-type]
                bytes_moved=nbytes,
            )
        )
        return t

    def _collective(
        self, op: OpNode, plan: BoxingPlan, step: BoxingStep, cur: dict[int, int], name: str
    ) -> dict[int, int]:
        pl, meta, kind = plan.src, plan.meta, COLLECTIVE[step.collective]
        out, tasks = {}, {}
        for coord in pl.coords():
            rank = pl.rank_at(coord)
            t = self._boxing_task(rank, op, K.TASK_KIND_BOXING, step, kind, step.bytes)
            self.read(t, cur[rank])
            out[rank] = self.produce(
                t, rank, local_shape(meta.shape, pl.shape, step.to_sbp, coord), meta.dtype, name
            )
            tasks[coord] = t
        if step.collective not in LOCAL:
            assert step.mesh_axis is not None
            for group in _groups(pl, step.mesh_axis):
                ranks = [pl.rank_at(c) for c in group]
                calls = [(tasks[c], pl.rank_at(c), kind, rank_send_bytes(step, plan, c)) for c in group]
                self.comm.add(pl.device_type, ranks, calls)
        return out

    def _p2p(
        self, op: OpNode, plan: BoxingPlan, step: BoxingStep, cur: dict[int, int], name: str
    ) -> dict[int, int]:
        meta, dst = plan.meta, plan.dst
        out = {}
        for coord in dst.coords():
            d = dst.rank_at(coord)
            want = local_shape(meta.shape, dst.shape, step.to_sbp, coord)
            by_src: dict[int, list[Transfer]] = {}
            for tr in step.transfers:
                if tr.dst == d:
                    by_src.setdefault(tr.src, []).append(tr)
            pieces = [
                cur[s] if s == d else self._send_recv(op, plan, step, cur[s], s, d, trs)
                for s, trs in by_src.items()
            ]
            received_whole = (
                len(pieces) == 1 and d not in by_src and self.registers[pieces[0]].shape == list(want)
            )
            if received_whole:  # the one received piece is the shard: name its register
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
            out[d] = self.produce(t, d, want, meta.dtype, name)
        return out

    def _send_recv(
        self,
        op: OpNode,
        plan: BoxingPlan,
        step: BoxingStep,
        source: int,
        s: int,
        d: int,
        transfers: list[Transfer],
    ) -> int:
        meta = plan.meta
        nbytes = sum(tr.numel for tr in transfers) * meta.dtype.itemsize
        send = self._boxing_task(s, op, K.TASK_KIND_SEND, step, pp.COLLECTIVE_KIND_SEND, nbytes)
        self.read(send, source)
        recv = self._boxing_task(d, op, K.TASK_KIND_RECV, step, pp.COLLECTIVE_KIND_RECV, nbytes)
        # one region arrives in its own shape; several (a shard cut by several source shards) arrive packed
        shape = (
            [r.stop - r.start for r in transfers[0].region]
            if len(transfers) == 1
            else [sum(t.numel for t in transfers)]
        )
        piece = self.produce(recv, d, shape, meta.dtype)
        self.comm.add(
            plan.src.device_type,
            pair_ranks(s, d),
            [(send, s, pp.COLLECTIVE_KIND_SEND, nbytes), (recv, d, pp.COLLECTIVE_KIND_RECV, 0)],
        )
        return piece


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
