"""Lowering writes what the runtime needs into the Plan as data (plan.proto, "the runtime never reads
``Plan.job``"): each task's mesh coordinate, each register's nd-SBP, each boxing task's step, and the
plan's tables — checked against the compiled graph, its placements and :func:`plan_boxing`, for the whole
plan and for the per-rank plans lowered on demand."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sbpflow.boxing import BoxingPlan, BoxingStep, Collective, plan_boxing
from sbpflow.codec import wire
from sbpflow.control_plane.compiler import pipeline
from sbpflow.control_plane.compiler.lowering import lower as lowering
from sbpflow.control_plane.compiler.lowering.boxing import region_proto, transfer_proto
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.graph import BOXING, Graph, OpNode
from sbpflow.job import Job
from sbpflow.oracle.reference import micro_batches
from sbpflow.placement import Placement, placement
from sbpflow.sbp import B, P, S
from sbpflow.sharding import shard_index
from sbpflow.v1 import plan_pb2 as pp
from tests.actor_workers.execution.test_executor import box_job
from tests.actor_workers.test_equivalence import gpt_job, mlp_dp2xtp2, mlp_job

K = pp.TaskKind
JOBS: dict[str, Callable[[], Job]] = {
    "mlp-dp2xtp2": mlp_dp2xtp2,
    "mlp-pp2xdp2": lambda: mlp_job(ranks=4, pp=2, micro_batches=4),
    "gpt-tp4": lambda: gpt_job(ranks=4, tp=True, heads=4),
    "box-2-to-3": lambda: box_job(
        (5, 3), placement("cpu", [0, 1]), (S(0),), placement("cpu", [2, 3, 4]), (S(1),)
    ),
    "box-2x2-P": lambda: box_job(
        (5, 6), placement("cpu", [[0, 1], [2, 3]]), (P, S(1)), placement("cpu", [[0, 1], [2, 3]]), (S(0), B)
    ),
}


def compiled(name: str) -> tuple[Graph, pp.Plan]:
    """The compiled graph and plan (a boxing-only job is lowered as it stands, as the executor tests do)."""
    job = JOBS[name]()
    if name.startswith("box"):
        return job.graph, lowering.run(CompileState.start(job))
    c = pipeline.compile(job)
    assert c.plan is not None, c.notes
    return c.state.graph, c.plan


def boxing_plan(g: Graph, op: OpNode) -> BoxingPlan:
    src, dst = g.tensors[op.inputs[0]], g.tensors[op.outputs[0]]
    assert src.placement and src.sbp is not None and dst.placement and dst.sbp is not None
    return plan_boxing(src.meta, src.placement, src.sbp, dst.placement, dst.sbp)


def task_placement(g: Graph, task: pp.Task, plan: BoxingPlan | None) -> Placement:
    """The placement whose grid a task's coordinate is in (plan.proto, Task.coord)."""
    if plan is not None:
        to_dst = task.kind == K.TASK_KIND_RECV or (
            task.kind == K.TASK_KIND_BOXING and task.boxing.point_to_point
        )
        return plan.dst if to_dst else plan.src
    ops = {o.name: o for o in g.ops}
    if task.kind in (K.TASK_KIND_KERNEL, K.TASK_KIND_OPTIMIZER):
        op = ops[task.op_name]
        where = op.placement or g.tensors[op.outputs[0]].placement
    else:
        where = g.tensors[task.op_name.removeprefix("accumulate/")].placement
    assert where is not None
    return where


@pytest.mark.parametrize("name", list(JOBS))
def test_every_task_carries_its_rank_s_coordinate_in_its_placement_s_grid(name: str) -> None:
    g, plan = compiled(name)
    ops = {o.name: o for o in g.ops}
    for d in plan.devices:
        for t in d.tasks:
            box = None
            if t.kind in (K.TASK_KIND_BOXING, K.TASK_KIND_SEND, K.TASK_KIND_RECV):
                box = boxing_plan(g, ops[t.op_name])
            assert tuple(t.coord) == task_placement(g, t, box).coord_of(d.rank), (t.op_name, t.kind)


@pytest.mark.parametrize("name", list(JOBS))
def test_register_sbps_are_the_compiled_tensors(name: str) -> None:
    g, plan, named = *compiled(name), 0
    for d in plan.devices:
        for r in d.registers:
            if r.tensor:
                named += 1
                assert wire.nd_sbp_from_proto(r.sbp) == g.tensors[r.tensor].sbp, r.tensor
    assert named


def expected_step(plan: BoxingPlan, i: int) -> BoxingStep:
    if plan.is_identity:
        return BoxingStep(Collective.local_slice, 0, plan.src_sbp, plan.dst_sbp, 0)
    return plan.steps[i]


def check_step_data(task: pp.Task, rank: int, plan: BoxingPlan) -> None:
    b = task.boxing
    step = expected_step(plan, b.step)
    assert (wire.nd_sbp_from_proto(b.from_nd_sbp), wire.nd_sbp_from_proto(b.to_nd_sbp)) == (
        step.from_sbp,
        step.to_sbp,
    )
    assert b.point_to_point == (step.collective is Collective.p2p)
    if not b.point_to_point:
        assert step.mesh_axis is not None and b.mesh_axis == step.mesh_axis
        k, coord = step.mesh_axis, plan.src.coord_of(rank)
        group = [plan.src.rank_at((*coord[:k], j, *coord[k + 1 :])) for j in range(plan.src.shape[k])]
        assert list(b.group) == group and b.bytes_moved == step.bytes
        return
    mine = {
        K.TASK_KIND_SEND: lambda tr: (tr.src, tr.dst) == (rank, b.peer),
        K.TASK_KIND_RECV: lambda tr: (tr.src, tr.dst) == (b.peer, rank),
        K.TASK_KIND_BOXING: lambda tr: tr.dst == rank,
    }[task.kind]
    assert list(b.transfers) == [transfer_proto(tr) for tr in step.transfers if mine(tr)]
    if task.kind == K.TASK_KIND_BOXING:
        want = shard_index(plan.meta.shape, plan.dst.shape, step.to_sbp, plan.dst.coord_of(rank))
        assert b.dst_region == region_proto(want)
    if task.kind == K.TASK_KIND_SEND or (task.kind == K.TASK_KIND_BOXING and rank in plan.src.ranks):
        own = shard_index(plan.meta.shape, plan.src.shape, step.from_sbp, plan.src.coord_of(rank))
        assert b.src_region == region_proto(own)


@pytest.mark.parametrize("name", list(JOBS))
def test_boxing_tasks_carry_plan_boxing_s_step_as_data(name: str) -> None:
    g, plan = compiled(name)
    ops, seen = {o.name: o for o in g.ops}, 0
    for d in plan.devices:
        for t in d.tasks:
            if t.kind in (K.TASK_KIND_BOXING, K.TASK_KIND_SEND, K.TASK_KIND_RECV):
                assert ops[t.op_name].op_type == BOXING
                check_step_data(t, d.rank, boxing_plan(g, ops[t.op_name]))
                seen += 1
    assert seen


@pytest.mark.parametrize("name", ["mlp-pp2xdp2", "gpt-tp4"])
def test_the_tables_are_the_compiled_job_s_and_on_demand_plans_carry_the_same(name: str) -> None:
    c = pipeline.compile(JOBS[name]())
    assert c.plan is not None
    job = c.plan.job
    assert list(c.plan.tensors) == list(job.graph.tensors) and list(c.plan.parameters) == list(job.parameters)
    assert not job.HasField("data") and c.plan.config == job.config  # the data source: Plan.data, once
    assert c.plan.data == wire.data_to_proto(c.state.job.data)
    assert (c.plan.loss, list(c.plan.fetches), c.plan.job_name) == (job.loss, list(job.fetches), job.name)
    assert c.plan.micro_batches == micro_batches(c.state.job)
    lazy = pipeline.compile(JOBS[name](), lower="lazy")
    header = pp.Plan()
    header.CopyFrom(c.plan)
    header.ClearField("devices")
    header.ClearField("communicators")
    header.ClearField("job")  # a rank plan's header: no job, only the tensors placed on the rank
    for d in c.plan.devices:
        got = lazy.rank_plan(d.rank)
        assert list(got.devices) == [d]
        got.ClearField("devices")
        got.ClearField("communicators")
        mine = [t for t in c.plan.tensors if d.rank in wire.placement_from_proto(t.placement).ranks]
        assert list(got.tensors) == mine and mine
        del header.tensors[:]
        header.tensors.extend(mine)
        assert got == header
