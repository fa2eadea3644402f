"""Lowering on demand: one rank's DevicePlan without the others', equal to its entry in the full plan;
the communicator order proved from the walk's boxing steps; the memory estimate per class of ranks."""

from __future__ import annotations

import pytest

from sbpflow.control_plane.compiler import comm_order, memory, pipeline
from sbpflow.control_plane.compiler.comm_order import Call, CommOrderError, GroupCall
from sbpflow.control_plane.compiler.lowering import lower as lowering
from sbpflow.control_plane.compiler.lowering.on_demand import check_order
from sbpflow.control_plane.compiler.lowering.tasks import LoweringError
from sbpflow.v1 import plan_pb2 as pp
from tests.control_plane.compiler.lowering.test_lower import mlp
from tests.control_plane.compiler.test_matrix import CONFIGS
from tests.examples.test_examples import load

# the layouts whose plans differ most: collectives on a 2-d mesh, point-to-point between stages, 1F1B
NAMES = ["mlp-dp2xtp2", "gpt-pp2xdp2", "gpt-pp4", "mlp-accum4", "gpt-zero3"]


@pytest.fixture(scope="module")
def both() -> dict[str, tuple[pipeline.Compiled, pipeline.Compiled]]:
    out = {}
    for name in NAMES:
        job = CONFIGS[name].job()
        out[name] = (pipeline.compile(job, lower="eager"), pipeline.compile(job, lower="lazy"))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_lowered_alone_equals_its_part_of_the_full_plan(both, name: str) -> None:
    eager, lazy = both[name]
    assert eager.plan is not None and lazy.plan is None and lazy.lazy is not None
    assert lazy.lazy.tasks == sum(len(d.tasks) for d in eager.plan.devices)
    assert lazy.memory == eager.memory  # one representative per class gives every rank's estimate
    for d in eager.plan.devices:
        assert lazy.device_plan(d.rank) == d  # ids, registers, comm_seq, memory: the same message
        assert eager.device_plan(d.rank) is d


@pytest.mark.parametrize("name", NAMES)
def test_a_rank_plan_carries_its_device_and_its_communicators(both, name: str) -> None:
    eager, lazy = both[name]
    assert eager.plan is not None
    comms = {c.id: list(c.ranks) for c in eager.plan.communicators}
    for d in eager.plan.devices:
        plan = lazy.rank_plan(d.rank)
        assert list(plan.devices) == [d] and not plan.HasField("job")  # the runtime never reads it
        assert {c.id: list(c.ranks) for c in plan.communicators} == {
            cid: comms[cid] for cid in {t.communicator for t in d.tasks if t.communicator}
        }


def test_partial_lowering_keeps_global_positions_and_only_the_built_steps() -> None:
    state = mlp("pp")
    full, part = lowering.run(state), lowering.lower(state, [1, 3])
    assert sorted(part.devices) == [1, 3]
    assert [part.devices[r] for r in (1, 3)] == [full.devices[1], full.devices[3]]
    for comm in part.communicators:
        assert {s.rank for s in comm.order} <= {1, 3}
    with pytest.raises(LoweringError, match=r"rank\(s\) \[9\] hold no tensor"):
        lowering.lower(state, [9])


def test_the_walk_proves_the_order_from_each_distinct_boxing_step() -> None:
    for mode in ("dp", "tp", "2d", "pp"):
        low = lowering.lower(mlp(mode), [], log=True)
        assert low.devices == {} and low.trail
        assert check_order(low) == len({(id(p), i) for _, p, i in low.trail})


def test_the_graph_level_check_refuses_a_call_a_member_misses_or_runs_as_another_primitive() -> None:
    ar, send, recv = pp.COLLECTIVE_KIND_ALL_REDUCE, pp.COLLECTIVE_KIND_SEND, pp.COLLECTIVE_KIND_RECV
    call = Call("boxing.x", "P -> B", "all_reduce", 64)
    comm_order.check_calls([GroupCall("cpu:0,1", (0, 1), call, ((0, ar), (1, ar)))])
    with pytest.raises(CommOrderError, match=r"cpu:0,1: call 0 .* runs on ranks \[0\]"):
        comm_order.check_calls([GroupCall("cpu:0,1", (0, 1), call, ((0, ar),))])
    p2p = Call("boxing.y", "S(0) -> S(0)", "send/recv", 64)
    with pytest.raises(CommOrderError, match="a send must face a receive"):
        comm_order.check_calls([GroupCall("cpu:0,1", (0, 1), p2p, ((0, send), (1, send)))])
    comm_order.check_calls([GroupCall("cpu:0,1", (0, 1), p2p, ((0, send), (1, recv)))])


def test_ranks_with_other_shard_shapes_are_other_memory_classes() -> None:
    uneven = memory.rank_classes(mlp("tp", hidden=10))  # the hidden dim splits 3, 3, 2, 2
    assert uneven == [(0, 1), (2, 3)]
    assert memory.rank_classes(mlp("tp", hidden=12)) == [(0, 1, 2, 3)]
    assert memory.rank_classes(mlp("pp")) == [(0, 1), (2, 3)]  # a stage each


def test_auto_materialises_small_jobs_and_lowers_big_ones_on_demand(monkeypatch) -> None:
    job = load("mlp").make_job(ranks=2)
    assert pipeline.compile(job).plan is not None
    monkeypatch.setattr(pipeline, "LAZY_ABOVE", 0)
    c = pipeline.compile(job)
    assert c.plan is None and c.lazy is not None and "lowered on demand" in c.notes[-1]
    assert "(lowered on demand)" in c.summary()
    assert {"rank classes", "lowering", "comm_order", "memory"} <= set(c.timings)
    none = pipeline.compile(job, lower=False)
    with pytest.raises(LoweringError, match="without lowering"):
        none.device_plan(0)
