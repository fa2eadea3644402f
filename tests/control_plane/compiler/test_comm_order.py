"""The communicator order: one global order per group of ranks, and the static check that rejects a
plan whose ranks disagree (the deadlock NCCL and PyTorch pipeline schedules hit)."""

from __future__ import annotations

import pytest

from sbpflow.control_plane.compiler import comm_order
from sbpflow.control_plane.compiler.comm_order import CommOrderError
from sbpflow.control_plane.compiler.lowering import lower as lowering
from sbpflow.graph import TensorKind
from sbpflow.placement import placement
from sbpflow.sbp import B, P, S
from sbpflow.v1 import plan_pb2 as pp
from tests.control_plane.compiler.lowering.test_lower import HandGraph, mlp

AR = pp.COLLECTIVE_KIND_ALL_REDUCE


def two_all_reduces() -> pp.Plan:
    """Two P -> B boxings on ranks 0..3, so the communicator orders two calls."""
    h = HandGraph()
    line = placement("cpu", [0, 1, 2, 3])
    x = h.tensor("x", (8, 6), TensorKind.input, line, (S(0),))
    a = h.op("a", "mean", [(x, (S(0),))], (P,), line)
    b = h.op("b", "sum", [(x, (S(0),))], (P,), line)
    c = h.op("c", "add", [(a, (B,)), (b, (B,))], (B,), line)
    return lowering.run(h.state(c))


def test_lowered_plans_pass() -> None:
    for mode in ("dp", "tp", "2d", "pp"):
        comm_order.check(lowering.run(mlp(mode)))
    comm_order.check(two_all_reduces())


def test_order_is_topological_and_every_task_points_at_its_step() -> None:
    plan = two_all_reduces()
    (comm,) = plan.communicators
    tasks = {t.id: t for d in plan.devices for t in d.tasks}
    assert [tasks[s.task_id].op_name for s in comm.order] == ["boxing.a.boxed0"] * 4 + ["boxing.b.boxed1"] * 4
    for i, s in enumerate(comm.order):
        assert tasks[s.task_id].communicator == comm.id and tasks[s.task_id].comm_seq == i


def _swap_rank_calls(plan: pp.Plan, rank: int) -> None:
    """Rank ``rank`` runs the two all-reduces in the other order (its steps swapped, pointers fixed)."""
    comm = plan.communicators[0]
    pos = [i for i, s in enumerate(comm.order) if s.rank == rank]
    a, b = comm.order[pos[0]], comm.order[pos[1]]
    ta, tb = pp.CommStep(), pp.CommStep()
    ta.CopyFrom(a)
    tb.CopyFrom(b)
    a.CopyFrom(tb)
    b.CopyFrom(ta)
    tasks = {t.id: t for d in plan.devices for t in d.tasks}
    tasks[a.task_id].comm_seq, tasks[b.task_id].comm_seq = pos[0], pos[1]


def test_a_rank_that_swaps_two_collectives_is_a_deadlock() -> None:
    plan = two_all_reduces()
    _swap_rank_calls(plan, 2)
    with pytest.raises(
        CommOrderError, match=r"cpu:0,1,2,3: call 0 .*boxing\.a.* on rank 0 but .*boxing\.b.* on rank 2"
    ):
        comm_order.check(plan)


def test_different_bytes_on_one_rank_are_a_mismatch() -> None:
    plan = two_all_reduces()
    t = next(t for t in plan.devices[1].tasks if t.communicator)
    t.boxing.bytes_moved += 4
    with pytest.raises(CommOrderError, match="on rank 1"):
        comm_order.check(plan)


def test_a_rank_missing_a_call_is_reported() -> None:
    plan = two_all_reduces()
    comm = plan.communicators[0]
    last = comm.order[-1]
    assert last.rank == 3
    del comm.order[-1]
    with pytest.raises(CommOrderError, match="rank 3 has only 1 calls"):
        comm_order.check(plan)


def test_a_step_and_its_task_must_name_each_other() -> None:
    plan = two_all_reduces()
    t = next(t for t in plan.devices[0].tasks if t.communicator)
    t.comm_seq = 5
    with pytest.raises(CommOrderError, match="must name each other"):
        comm_order.check(plan)


def test_send_must_face_recv() -> None:
    plan = lowering.run(mlp("pp"))
    comm = next(c for c in plan.communicators if c.id == "cpu:0,2")
    recv = next(s for s in comm.order if s.kind == pp.COLLECTIVE_KIND_RECV)
    recv.kind = pp.COLLECTIVE_KIND_SEND
    with pytest.raises(CommOrderError, match="a send must face a receive"):
        comm_order.check(plan)


def _cycle_plan() -> pp.Plan:
    """Three pairwise communicators; each rank runs its two calls in an order that closes a cycle."""
    plan = pp.Plan(format_version=1)
    orders = {0: ["cpu:0,1", "cpu:0,2"], 1: ["cpu:1,2", "cpu:0,1"], 2: ["cpu:0,2", "cpu:1,2"]}
    comms = {
        cid: pp.Communicator(id=cid, ranks=[int(r) for r in cid[4:].split(",")])
        for cid in orders[0] + orders[1]
    }
    tid = 0
    for rank, cids in orders.items():
        d = plan.devices.add(rank=rank, device_type=1)  # type: ignore[arg-type]
        for cid in cids:
            t = d.tasks.add(id=tid, kind=pp.TASK_KIND_BOXING, op_name=cid, communicator=cid)
            t.boxing.collective = AR
            tid += 1
    for d in plan.devices:
        for t in d.tasks:
            comm = comms[t.communicator]
            t.comm_seq = len(comm.order)
            comm.order.add(task_id=t.id, rank=d.rank, kind=AR)
    plan.communicators.extend(comms[c] for c in sorted(comms))
    return plan


def test_a_cycle_across_communicators_is_a_deadlock() -> None:
    with pytest.raises(CommOrderError, match="across communicators"):
        comm_order.check(_cycle_plan())


def test_communicator_ids_name_device_and_ranks() -> None:
    assert comm_order.communicator_id("cuda", [2, 3]) == "cuda:2,3"
    assert comm_order.pair_ranks(3, 1) == (1, 3)
