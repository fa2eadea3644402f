"""Lowering: tasks per (op, rank), registers with local shard bytes, boxing steps and their communicators.

The graphs here are compiled by hand (every tensor's placement and SBP set, boxing nodes inserted with
``plan_boxing``) so that lowering is tested on its input contract alone, independent of the SBP and
boxing passes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from math import prod

import pytest

from sbpflow.boxing import plan_boxing
from sbpflow.control_plane.compiler import comm_order
from sbpflow.control_plane.compiler.lowering import lower as lowering
from sbpflow.control_plane.compiler.lowering.tasks import LoweringError
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.dtype import DType
from sbpflow.graph import BOXING, Graph, OpNode, TensorDecl, TensorKind
from sbpflow.job import Job
from sbpflow.ops.base import get_op
from sbpflow.placement import Placement, placement
from sbpflow.sbp import B, NdSbp, P, S
from sbpflow.sharding import local_shape
from sbpflow.tensor_meta import TensorMeta
from sbpflow.v1 import plan_pb2 as pp

F32 = DType.float32


class HandGraph:
    """Build a compiled graph op by op: each op names its output SBP; inputs are boxed as asked."""

    def __init__(self) -> None:
        self.g = Graph()
        self.boxings: dict = {}

    def tensor(
        self, name: str, shape: tuple[int, ...], kind: TensorKind, where: Placement, sbp: NdSbp
    ) -> str:
        self.g.add_tensor(TensorDecl(name, TensorMeta(shape, F32), kind, where, sbp))
        return name

    def box(self, name: str, where: Placement, sbp: NdSbp) -> str:
        src = self.g.tensors[name]
        if (src.placement, src.sbp) == (where, sbp):
            return name
        out = f"{name}.boxed{len(self.boxings)}"
        self.g.add_tensor(replace(src, name=out, kind=TensorKind.activation, placement=where, sbp=sbp))
        node = OpNode(f"boxing.{out}", BOXING, (name,), (out,), placement=where)
        self.g.add_op(node)
        assert src.placement is not None and src.sbp is not None
        self.boxings[node.name] = plan_boxing(src.meta, src.placement, src.sbp, where, sbp)
        return out

    def op(
        self,
        name: str,
        op_type: str,
        ins: list[tuple[str, NdSbp]],
        out_sbp: NdSbp,
        where: Placement,
        stage: int = 0,
        **attrs,
    ) -> str:
        inputs = tuple(self.box(i, where, s) for i, s in ins)
        opdef = get_op(op_type)
        metas = tuple(self.g.tensors[i].meta for i in inputs)
        (meta,) = opdef.run_infer(metas, opdef.normalize_attrs(attrs))
        sigs = opdef.nd_signatures(metas, opdef.normalize_attrs(attrs), where.shape)
        chosen = tuple(s for _, s in ins)
        assert any(sg.ins == chosen and sg.outs == (out_sbp,) for sg in sigs), (name, chosen, out_sbp)
        self.g.add_tensor(TensorDecl(name, meta, TensorKind.activation, where, out_sbp))
        self.g.add_op(OpNode(name, op_type, inputs, (name,), attrs, where, stage))
        return name

    def state(self, loss: str = "", updates: dict[str, str] | None = None) -> CompileState:
        self.g.verify()
        job = Job("hand", self.g, loss=loss, fetches=(loss,) if loss else ())
        s = CompileState(job, self.g, boxings=dict(self.boxings))
        s.updates = dict(updates or {})
        return s


def mlp(mode: str, p: int = 4, hidden: int = 10) -> CompileState:
    """x[8,6] -> matmul w1[6,hidden] -> relu -> matmul w2[hidden,3] -> mean: a forward MLP, compiled by hand.

    ``dp``: x S(0), weights B, loss P -> B (all-reduce). ``tp``: w1 S(1), w2 S(0) (Megatron), the second
    matmul gives P, all-reduced. ``2d``: DP x TP on a 2 x (p/2) mesh. ``pp``: layer 1 on ranks 0..p/2-1,
    layer 2 on the rest (point-to-point between the placements).
    """
    h = HandGraph()
    if mode == "2d":
        mesh = placement("cpu", [[r * (p // 2) + c for c in range(p // 2)] for r in range(2)])
        x = h.tensor("x", (8, 6), TensorKind.input, mesh, (S(0), B))
        w1 = h.tensor("w1", (6, hidden), TensorKind.parameter, mesh, (B, S(1)))
        w2 = h.tensor("w2", (hidden, 3), TensorKind.parameter, mesh, (B, S(0)))
        a = h.op("mm1", "matmul", [(x, (S(0), B)), (w1, (B, S(1)))], (S(0), S(1)), mesh)
        r = h.op("relu", "relu", [(a, (S(0), S(1)))], (S(0), S(1)), mesh)
        y = h.op("mm2", "matmul", [(r, (S(0), S(1))), (w2, (B, S(0)))], (S(0), P), mesh)
        loss = h.op("loss", "mean", [(y, (S(0), B))], (P, B), mesh)
        return h.state(h.box(loss, mesh, (B, B)))
    line = placement("cpu", list(range(p)))
    first = placement("cpu", list(range(p // 2))) if mode == "pp" else line
    second = placement("cpu", list(range(p // 2, p))) if mode == "pp" else line
    xs = {"dp": S(0), "tp": B, "pp": S(0)}[mode]
    w1s, w2s = {"dp": (B, B), "tp": (S(1), S(0)), "pp": (B, B)}[mode]
    x = h.tensor("x", (8, 6), TensorKind.input, first, (xs,))
    w1 = h.tensor("w1", (6, hidden), TensorKind.parameter, first, (w1s,))
    w2 = h.tensor("w2", (hidden, 3), TensorKind.parameter, second, (w2s,))
    hs = S(1) if mode == "tp" else S(0)
    a = h.op("mm1", "matmul", [(x, (xs,)), (w1, (w1s,))], (hs,), first)
    r = h.op("relu", "relu", [(a, (hs,))], (hs,), first, stage=0)
    stage = 1 if mode == "pp" else 0
    ys = P if mode == "tp" else S(0)
    y = h.op("mm2", "matmul", [(r, (hs,)), (w2, (w2s,))], (ys,), second, stage=stage)
    loss = h.op(
        "loss", "mean", [(y, (ys if mode != "tp" else B,))], (P if mode != "tp" else B,), second, stage=stage
    )
    return h.state(h.box(loss, second, (B,)))


def tasks_of(plan: pp.Plan) -> list[tuple[int, pp.Task]]:
    return [(d.rank, t) for d in plan.devices for t in d.tasks]


@pytest.mark.parametrize("mode", ["dp", "tp", "2d", "pp"])
def test_one_task_per_op_and_rank_with_unique_ids(mode: str) -> None:
    state = mlp(mode)
    plan = lowering.run(state)
    assert [d.rank for d in plan.devices] == [0, 1, 2, 3]
    ids = [t.id for _, t in tasks_of(plan)]
    assert len(ids) == len(set(ids))
    regs = [r.id for d in plan.devices for r in d.registers]
    assert len(regs) == len(set(regs))
    kernels = Counter(t.op_name for _, t in tasks_of(plan) if t.kind == pp.TASK_KIND_KERNEL)
    for op in state.graph.ops:
        if op.op_type != BOXING:
            assert op.placement is not None
            assert kernels[op.name] == op.placement.size, op.name
    comm_order.check(plan)


def test_register_bytes_are_the_local_shard_bytes_uneven_splits_included() -> None:
    state = mlp("tp", p=4, hidden=10)  # w1 [6, 10] S(1) over 4 ranks: columns 3, 3, 2, 2
    plan = lowering.run(state)
    for d in plan.devices:
        (w1,) = [r for r in d.registers if r.tensor == "w1"]
        assert list(w1.shape) == [6, [3, 3, 2, 2][d.rank]]
        assert w1.bytes == 6 * [3, 3, 2, 2][d.rank] * 4
        for reg in d.registers:
            if reg.tensor:
                decl = state.graph.tensors[reg.tensor]
                assert decl.placement is not None and decl.sbp is not None
                coord = decl.placement.coords()[decl.placement.ranks.index(d.rank)]
                assert list(reg.shape) == list(
                    local_shape(decl.meta.shape, decl.placement.shape, decl.sbp, coord)
                )
                assert reg.bytes == prod(reg.shape) * 4


def test_task_kinds_streams_and_register_counts() -> None:
    plan = lowering.run(mlp("dp"))
    d0 = plan.devices[0]
    kinds = {t.op_name: t for t in d0.tasks if t.kind != pp.TASK_KIND_BOXING}
    assert kinds["x"].kind == pp.TASK_KIND_DATA_LOAD and kinds["x"].stream == pp.STREAM_KIND_DATA
    assert kinds["w1"].kind == pp.TASK_KIND_SOURCE
    assert kinds["mm1"].kind == pp.TASK_KIND_KERNEL and kinds["mm1"].stream == pp.STREAM_KIND_COMPUTE
    assert kinds["mm1"].op_type == "matmul" and kinds["mm1"].attrs["transpose_a"].b is False
    regs = {r.id: r for r in d0.registers}
    assert regs[kinds["x"].out_registers[0]].count == 2  # the loader prefetches
    assert regs[kinds["mm1"].out_registers[0]].count == 1
    sink = [t for t in d0.tasks if t.kind == pp.TASK_KIND_SINK]
    assert len(sink) == 1 and sink[0].attrs["fetch"].s.startswith("loss")
    # every register's consumers read it, on the same device
    tasks = {t.id: t for t in d0.tasks}
    for r in d0.registers:
        assert r.producer_task in tasks and r.id in tasks[r.producer_task].out_registers
        for c in r.consumer_tasks:
            assert r.id in tasks[c].in_registers


@pytest.mark.parametrize("mode", ["dp", "tp", "2d"])
def test_collective_steps_and_per_rank_bytes_add_up_to_the_boxing_plan(mode: str) -> None:
    state = mlp(mode)
    plan = lowering.run(state)
    boxing_tasks = [(r, t) for r, t in tasks_of(plan) if t.kind == pp.TASK_KIND_BOXING]
    assert boxing_tasks
    steps = {s.task_id: s for c in plan.communicators for s in c.order}
    for name, bplan in state.boxings.items():
        mine = [(r, t) for r, t in boxing_tasks if t.op_name == name]
        assert len(mine) == len(bplan.steps) * bplan.src.size  # one task per step per rank
        sent = sum(steps[t.id].bytes for _, t in mine if t.id in steps)
        assert sent == bplan.bytes
        assert {t.stream for _, t in mine} == {pp.STREAM_KIND_COMMUNICATION}


def test_dp_loss_all_reduce_runs_on_one_communicator_of_all_ranks() -> None:
    plan = lowering.run(mlp("dp"))
    (comm,) = plan.communicators
    assert comm.id == "cpu:0,1,2,3" and list(comm.ranks) == [0, 1, 2, 3]
    assert [s.kind for s in comm.order] == [pp.COLLECTIVE_KIND_ALL_REDUCE] * 4
    assert sorted(s.rank for s in comm.order) == [0, 1, 2, 3]
    for _, t in tasks_of(plan):
        if t.kind == pp.TASK_KIND_BOXING:
            assert t.boxing.from_sbp == "P" and t.boxing.to_sbp == "B"
            assert t.boxing.bytes_moved == 2 * 3 * 4  # 2(p-1)|T| for a float32 scalar


def test_2d_mesh_collectives_run_per_group_of_the_mesh_axis() -> None:
    plan = lowering.run(mlp("2d"))
    ids = {c.id for c in plan.communicators}
    # rows [0,1] and [2,3] run the TP axis; columns [0,2] and [1,3] the DP axis
    assert {"cpu:0,1", "cpu:2,3", "cpu:0,2", "cpu:1,3"} <= ids
    comm_order.check(plan)


def test_pipeline_boxing_is_send_recv_between_placements() -> None:
    state = mlp("pp")
    plan = lowering.run(state)
    sends = [(r, t) for r, t in tasks_of(plan) if t.kind == pp.TASK_KIND_SEND]
    recvs = [(r, t) for r, t in tasks_of(plan) if t.kind == pp.TASK_KIND_RECV]
    assert {r for r, _ in sends} == {0, 1} and {r for r, _ in recvs} == {2, 3}
    (bplan,) = [b for b in state.boxings.values() if b.src != b.dst]
    assert sum(t.boxing.bytes_moved for _, t in sends) == bplan.bytes == 8 * 10 * 4
    for _, t in sends + recvs:
        assert t.stream == pp.STREAM_KIND_COMMUNICATION and t.communicator in {"cpu:0,2", "cpu:1,3"}
    stages = {t.op_name: t.stage for _, t in tasks_of(plan) if t.kind == pp.TASK_KIND_KERNEL}
    assert stages["mm1"] == 0 and stages["mm2"] == 1
    # the received shard is the consumer's input register on ranks 2 and 3
    for d in plan.devices[2:]:
        (mm2,) = [t for t in d.tasks if t.op_name == "mm2"]
        regs = {r.id: r for r in d.registers}
        assert regs[mm2.in_registers[0]].tensor.startswith("relu.boxed")
    comm_order.check(plan)


def test_uneven_cross_placement_boxing_assembles_pieces() -> None:
    h = HandGraph()
    two, three = placement("cpu", [0, 1]), placement("cpu", [2, 3, 4])
    x = h.tensor("x", (7, 5), TensorKind.input, two, (S(0),))
    y = h.op("y", "relu", [(x, (S(0),))], (S(0),), two)
    z = h.op("z", "relu", [(y, (S(0),))], (S(0),), three)  # 4,3 rows -> 3,2,2 rows: rank 3 takes from both
    state = h.state(z)
    plan = lowering.run(state)
    comm_order.check(plan)
    d3 = next(d for d in plan.devices if d.rank == 3)
    (assemble,) = [t for t in d3.tasks if t.kind == pp.TASK_KIND_BOXING]
    assert assemble.boxing.collective == pp.COLLECTIVE_KIND_LOCAL_SLICE and len(assemble.in_registers) == 2
    (out,) = [r for r in d3.registers if r.id == assemble.out_registers[0]]
    assert list(out.shape) == [2, 5] and out.tensor.startswith("y.boxed")
    sent = sum(t.boxing.bytes_moved for _, t in tasks_of(plan) if t.kind == pp.TASK_KIND_SEND)
    assert sent == next(iter(state.boxings.values())).bytes == 7 * 5 * 4


def test_updates_become_assign_sinks_and_mismatched_updates_are_refused() -> None:
    h = HandGraph()
    line = placement("cpu", [0, 1])
    w = h.tensor("w", (4, 2), TensorKind.parameter, line, (S(0),))
    nw = h.op("w.new", "relu", [(w, (S(0),))], (S(0),), line)
    plan = lowering.run(h.state(updates={w: nw}))
    sinks = [t for _, t in tasks_of(plan) if t.kind == pp.TASK_KIND_SINK]
    assert len(sinks) == 2 and all(t.attrs["assign"].s == "w" for t in sinks)
    h2 = HandGraph()
    w = h2.tensor("w", (4, 2), TensorKind.parameter, line, (S(0),))
    nw = h2.op("w.new", "relu", [(w, (B,))], (B,), line)
    with pytest.raises(LoweringError, match=r"w\.new.*placement and SBP"):
        lowering.run(h2.state(updates={w: nw}))


def test_missing_layout_is_refused_with_the_fix() -> None:
    g = Graph()
    g.add_tensor(TensorDecl("x", TensorMeta((2,), F32), TensorKind.input))
    with pytest.raises(LoweringError, match="SBP inference"):
        lowering.run(CompileState(Job("j", g), g))


def test_plan_carries_the_compiled_job_and_round_trips() -> None:
    plan = lowering.run(mlp("tp"))
    back = pp.Plan.FromString(plan.SerializeToString())
    assert back == plan and back.format_version == 1
    assert any(o.op_type == BOXING for o in back.job.graph.ops)


def test_a_whole_received_shard_needs_no_assembly_and_partial_ranks_zero_fill() -> None:
    h = HandGraph()
    two, other = placement("cpu", [0, 1]), placement("cpu", [2, 3])
    x = h.tensor("x", (4, 3), TensorKind.input, two, (B,))
    y = h.op("y", "relu", [(x, (B,))], (B,), two)
    z = h.op("z", "mul_scalar", [(y, (P,))], (P,), other, value=2.0)  # B on [0,1] -> P on [2,3]
    plan = lowering.run(h.state(z))
    comm_order.check(plan)
    d2, d3 = plan.devices[2], plan.devices[3]
    assert [t.kind for t in d2.tasks if t.op_name.startswith("boxing")] == [pp.TASK_KIND_RECV]
    (fill,) = [t for t in d3.tasks if t.op_name.startswith("boxing")]
    assert fill.boxing.collective == pp.COLLECTIVE_KIND_ZERO_FILL and not fill.in_registers
    for d in (d2, d3):
        (boxed,) = [r for r in d.registers if r.tensor.startswith("y.boxed")]
        assert list(boxed.shape) == [4, 3]


@pytest.mark.parametrize("mode", ["dp", "pp"])
def test_a_step_of_one_micro_batch_has_no_micro_batch_dimension(mode: str) -> None:
    plan = lowering.run(mlp(mode))
    assert {t.micro_batch for _, t in tasks_of(plan)} == {-1}
    assert not [t for _, t in tasks_of(plan) if t.kind == pp.TASK_KIND_ACCUMULATE]
