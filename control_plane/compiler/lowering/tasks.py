"""Lowering's task emission: the id counters, and the tasks and registers of every op but a boxing.

:class:`TaskEmitter` holds one walk's state: the DevicePlans being built, the register each rank holds
for each tensor (per micro-batch), and the id counters. Ids count every rank's tasks and registers,
built or not: an emission walks its placement's ranks in row-major order, and a rank that is not built
only advances the counters (by what each rank emits), so a rank's DevicePlan has the full plan's ids.
Boxing steps are emitted by its subclass :class:`~sbpflow.control_plane.compiler.lowering.boxing.Lowerer`.

Register bytes are the LOCAL shard bytes on that rank, so uneven splits are exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

from sbpflow.codec import wire
from sbpflow.dtype import DType
from sbpflow.errors import SbpflowError
from sbpflow.graph import Graph, OpNode, TensorDecl, TensorKind
from sbpflow.limits import CompileBudget
from sbpflow.ops.training.loss_scaling import GATED
from sbpflow.ops.training.optim import CLIPPED
from sbpflow.placement import Placement
from sbpflow.sbp import NdSbp
from sbpflow.sharding import local_shape
from sbpflow.tensor_meta import Shape
from sbpflow.v1 import job_pb2 as jp
from sbpflow.v1 import plan_pb2 as pp

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
# The updates: plain, with clipping folded in (folds.fold_clips) and gated by loss scaling. An OPTIMIZER task
# writes a variable's new value into its value two steps back (executor_analysis.recyclers).
OPTIMIZER_OPS = frozenset({"sgd_update", "adamw_update", *CLIPPED.values(), *GATED.values()})


class LoweringError(SbpflowError, ValueError):
    """The graph does not satisfy lowering's input contract (layout missing or inconsistent)."""


def placement_of(g: Graph, op: OpNode) -> Placement:
    where = op.placement or g.tensors[op.outputs[0]].placement
    assert where is not None
    return where


@lru_cache(maxsize=4096)
def rank_coords(pl: Placement) -> tuple[tuple[int, ...], ...]:
    return tuple(pl.coords())


@lru_cache(maxsize=1 << 16)
def shard_shape(
    shape: Shape, mesh: tuple[int, ...], nd_sbp: NdSbp, coord: tuple[int, ...]
) -> tuple[int, ...]:
    """``local_shape``, cached: a big job asks for the same few shard shapes millions of times."""
    return tuple(local_shape(shape, mesh, nd_sbp, coord))


@dataclass
class TaskEmitter:
    """The state of one walk and the emission of every task but a boxing step's (module docstring)."""

    graph: Graph
    devices: dict[int, pp.DevicePlan]  # the ranks whose tasks are built
    keep: frozenset[int] | None = None  # those ranks; None: every rank
    held: dict[tuple[str, int, int], int] = field(
        default_factory=dict
    )  # (tensor, rank, micro-batch) -> register
    micro_batch: int = -1  # of the tasks being emitted; -1 = once per step
    registers: dict[int, pp.RegisterDesc] = field(default_factory=dict)
    next_task: int = 0  # ids count every rank's tasks and registers, built or not
    next_reg: int = 0
    _chosen: dict[Placement, list[int]] = field(default_factory=dict)
    _attrs: dict[str, list[tuple[str, object]]] = field(default_factory=dict)
    _sbps: dict[NdSbp, jp.NdSbp] = field(default_factory=dict)  # nd-SBP -> its proto, made once
    budget: CompileBudget | None = None  # counts what is built; raises over its limits or once cancelled

    # ---- primitives ---------------------------------------------------------------------------

    def each(self, pl: Placement, tasks: int, registers: int) -> Iterator[tuple[tuple[int, ...], int]]:
        """(coordinate, rank) of each built rank of ``pl`` in row-major order, with the id counters where
        the full plan has them for that rank (each rank emits ``tasks`` tasks and ``registers`` registers);
        after the loop, the counters are past every rank of ``pl``."""
        coords = rank_coords(pl)
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

    def seek(self, task: int, register: int) -> None:
        """Move the id counters to where the full plan is (an emission that skips ranks it does not build)."""
        self.next_task, self.next_reg = task, register

    def task(
        self, rank: int, kind: int, op_name: str = "", stage: int = 0, coord: Sequence[int] = ()
    ) -> pp.Task | None:
        """A new task on ``rank`` at mesh coordinate ``coord``; ``None`` (its id counted) when that rank
        is not built."""
        tid = self.next_task
        self.next_task += 1
        device = self.devices.get(rank)
        if device is None:
            return None
        if self.budget is not None:
            self.budget.made(tasks=1)
        return device.tasks.add(
            id=tid,
            kind=kind,
            stream=STREAM[kind],
            op_name=op_name,
            stage=stage,
            micro_batch=self.micro_batch,
            coord=coord,
        )  # type: ignore[arg-type]

    def like(self, rank: int, proto: pp.Task, coord: Sequence[int]) -> pp.Task | None:
        """A new task on ``rank`` equal to ``proto`` (what every rank and micro-batch of an emission shares)
        but for its id and coordinate: :meth:`task`'s, without building the shared part again."""
        tid = self.next_task
        self.next_task += 1
        device = self.devices.get(rank)
        if device is None:
            return None
        if self.budget is not None:
            self.budget.made(tasks=1)
        t = device.tasks.add()
        t.CopyFrom(proto)
        t.id = tid
        t.coord.extend(coord)
        return t

    def sbp_proto(self, nd: NdSbp) -> jp.NdSbp:
        m = self._sbps.get(nd)
        if m is None:
            m = self._sbps[nd] = wire.nd_sbp_to_proto(nd)
        return m

    def produce(
        self,
        task: pp.Task | None,
        rank: int,
        shape: Sequence[int],
        dtype: DType,
        tensor: str = "",
        hold: bool = True,
        sbp: NdSbp | None = None,
    ) -> int:
        rid = self.next_reg
        self.next_reg += 1
        if task is None:
            return -1
        if self.budget is not None:
            self.budget.made(registers=1)
        reg = self.devices[rank].registers.add(
            id=rid,
            producer_task=task.id,
            count=REGISTER_COUNT.get(task.kind, 1),
            bytes=prod(shape) * dtype.itemsize,
            shape=shape,
            dtype=wire.dtype_to_proto(dtype),
            tensor=tensor,
        )  # type: ignore[arg-type]
        if sbp is not None:
            reg.sbp.CopyFrom(self.sbp_proto(sbp))
        task.out_registers.append(rid)
        self.registers[rid] = reg
        if tensor and hold:
            self.held[(tensor, rank, self.micro_batch)] = rid
        return rid

    def read(self, task: pp.Task | None, register: int) -> None:
        if task is not None:
            task.in_registers.append(register)
            self.registers[register].consumer_tasks.append(task.id)

    def holder(self, tensor: str, rank: int, who: str | OpNode) -> int:
        """This micro-batch's register of ``tensor`` on ``rank``, else the per-step one; ``who`` reads it
        (an op, or what the error names)."""
        reg = self.held.get((tensor, rank, self.micro_batch))
        reg = self.held.get((tensor, rank, -1)) if reg is None else reg
        if reg is None:
            if isinstance(who, OpNode):  # formatted only here: kernels read millions of registers
                who = f"op {who.name!r} ({who.op_type})"
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
        return self.produce(task, rank, shape, decl.meta.dtype, decl.name, hold, decl.sbp)

    # ---- tensors that enter the step, ops, tensors that leave it ----------------------------

    def emit_source(self, decl: TensorDecl, kind: int) -> None:
        assert decl.placement is not None
        for coord, rank in self.each(decl.placement, 1, 1):
            self.produce_shard(self.task(rank, kind, decl.name, 0, coord), rank, decl, coord)

    def emit_accumulate(self, tensor: str, k: int, m: int, stage: int) -> None:
        """Micro-batch ``k``'s share of the running mean of ``tensor`` over ``m`` micro-batches: a running
        sum in one buffer (``((g0 + g1) + g2) + g3``, the reference's order), divided by ``m`` at the last;
        the last one's register is the per-step value everything after the micro-batches reads."""
        decl = self.graph.tensors[tensor]
        assert decl.placement is not None
        kind, proto = K.TASK_KIND_ACCUMULATE, None
        for coord, rank in self.each(decl.placement, 1, 1):
            if proto is None:
                proto = pp.Task(
                    kind=kind,
                    stream=STREAM[kind],  # type: ignore[arg-type]
                    op_name=f"accumulate/{tensor}",
                    stage=stage,
                    micro_batch=self.micro_batch,
                )
                proto.attrs["tensor"].CopyFrom(wire.attr_to_proto(tensor))
                proto.attrs["first"].CopyFrom(wire.attr_to_proto(k == 0))
                proto.attrs["divide_by"].CopyFrom(wire.attr_to_proto(m if k == m - 1 else 1))
            t = self.like(rank, proto, coord)
            assert t is not None
            if k > 0:
                self.read(t, self.held[(tensor, rank, -2)])  # the running sum so far
            self.read(t, self.holder(tensor, rank, f"accumulation of {tensor!r}"))
            reg = self.produce_shard(t, rank, decl, coord, hold=False)
            self.held[(tensor, rank, -1 if k == m - 1 else -2)] = reg

    def emit_kernel(self, op: OpNode) -> None:
        where = placement_of(self.graph, op)
        kind = K.TASK_KIND_OPTIMIZER if op.op_type in OPTIMIZER_OPS else K.TASK_KIND_KERNEL
        outs = [self.graph.tensors[o] for o in op.outputs]
        for o in outs:
            if o.placement != where:
                raise LoweringError(
                    f"op {op.name!r} ({op.op_type}) runs on {where} but writes {o!r}; an op writes on its placement"
                )
        proto = None
        for coord, rank in self.each(where, 1, len(outs)):
            if proto is None:  # what this emission's tasks share, built once
                proto = pp.Task(
                    kind=kind,
                    stream=STREAM[kind],  # type: ignore[arg-type]
                    op_name=op.name,
                    stage=op.stage,
                    micro_batch=self.micro_batch,
                    op_type=op.op_type,
                )
                attrs = self._attrs.get(op.name)
                if attrs is None:  # once per op, not per (rank, micro-batch)
                    attrs = self._attrs[op.name] = [(k, wire.attr_to_proto(v)) for k, v in op.attrs.items()]
                for k, v in attrs:
                    proto.attrs[k].CopyFrom(v)  # type: ignore[arg-type]
            t = self.like(rank, proto, coord)
            assert t is not None
            for i in op.inputs:
                self.read(t, self.holder(i, rank, op))
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
        for coord, rank in self.each(where, 1, 0):
            t = self.task(rank, K.TASK_KIND_SINK, op_name, 0, coord)
            assert t is not None
            t.attrs[attr].CopyFrom(wire.attr_to_proto(value))
            self.read(t, self.holder(tensor, rank, f"{attr} of {op_name!r}"))
