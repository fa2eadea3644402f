"""The memory plan of values that readers view (a reshape, a transpose, a split): the value lives until
its views' readers have acted, and a slab is lent only when every read of the value and of its views is
done and no view of it is alive.

The plan is read off a small hand-made DevicePlan (a chain of views is followed; a view that escapes
leaves its value out), the run-time count and the refcount guard are checked on their own and through
the engine, and the main job and BERT, whose attention reads its values through reshape / transpose /
split chains, train bit-identically with the plan on and off and with views planned or not.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.execution import executor_analysis, memory_plan, plan_tables
from sbpflow.actor_workers.execution.memory_pack import Lifetime, pack
from sbpflow.actor_workers.execution.memory_plan import Lender, Planned, Read, Slab, follow, watch
from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.control_plane.compiler import pipeline
from sbpflow.v1 import plan_pb2 as pp
from tests.actor_workers.execution.test_memory_plan import JOBS, train, unfolded

STEPS = 4
K, C, S, B = pp.TASK_KIND_KERNEL, pp.STREAM_KIND_COMPUTE, pp.TASK_KIND_SINK, pp.TASK_KIND_BOXING


# ---- the plan: a chain of views is followed, a view that escapes leaves the value out --------------------


def device(*tasks: tuple[int, int, str, tuple[int, ...], tuple[int, ...]], counts: Any = None) -> Any:
    """A DevicePlan of ``tasks`` (id, kind, op type, in registers, out registers), on the compute stream
    but for boxings; each register's producer and consumers from them (``counts``: register -> slots)."""
    d = pp.DevicePlan()
    made: dict[int, Any] = {}
    for tid, kind, op, ins, outs in tasks:
        stream = pp.STREAM_KIND_COMMUNICATION if kind == B else C
        d.tasks.add(id=tid, kind=kind, op_type=op, stream=stream, in_registers=ins, out_registers=outs)
        for r in outs:
            made[r] = d.registers.add(id=r, producer_task=tid, count=(counts or {}).get(r, 1), tensor=f"t{r}")
    for tid, _, _, ins, _ in tasks:
        for r in ins:
            made[r].consumer_tasks.append(tid)
    return d


def followed(d: Any, register: int = 1) -> memory_plan.Followed | None:
    by_id = {t.id: t for t in d.tasks}
    regs = {r.id: r for r in d.registers}
    return follow(regs[register], regs, by_id, frozenset())


# x (1) -> transpose (2) -> reshape (3) -> matmul, and x -> relu: reads of x, its view and its view's view
CHAIN = [
    (0, K, "relu", (), (1,)),
    (1, K, "transpose", (1,), (2,)),
    (2, K, "reshape", (2,), (3,)),
    (3, K, "matmul", (3,), (4,)),
    (4, K, "relu", (1,), (5,)),
]


def test_a_chain_of_views_is_followed_to_its_last_reader() -> None:
    f = followed(device(*CHAIN))
    assert f is not None
    assert f.reads == 4  # transpose and relu read x, reshape the transpose, matmul the reshape
    assert set(f.tasks) == {1, 2, 3, 4}  # the lifetime ends at the matmul, not at the transpose
    assert dict(f.views) == {2: 2, 3: 1}  # each view's reads below it


@pytest.mark.parametrize(
    "escape",
    [
        [(5, S, "", (3,), ())],  # a fetch or an assign reads the view
        [(5, B, "", (2,), (6,))],  # a boxing sends it
        [(5, K, "pack", (3, 4), (6,))],  # a view of two values
    ],
)
def test_a_value_whose_view_escapes_is_not_planned(escape: list[Any]) -> None:
    assert followed(device(*CHAIN)) is not None
    assert followed(device(*CHAIN, *escape)) is None


def test_a_view_of_more_than_one_slot_or_made_by_a_looped_kernel_is_not_planned() -> None:
    assert followed(device(*CHAIN, counts={3: 2})) is None
    d = device(*CHAIN)
    regs = {r.id: r for r in d.registers}
    assert follow(regs[1], regs, {t.id: t for t in d.tasks}, frozenset(), frozenset({2})) is None


def test_without_plan_views_a_value_its_reader_views_is_not_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_plan, "PLAN_VIEWS", False)
    assert followed(device(*CHAIN)) is None
    assert followed(device(*CHAIN), register=4) is not None  # the matmul's output: no view of it


# ---- the run-time count and the refcount guard ------------------------------------------------------------


def shared(readers: int) -> tuple[Planned, Planned]:
    slab = Slab(48)
    a = Planned(slab, slab.view((2, 3), np.dtype(np.float64)), readers)
    b = Planned(slab, slab.view((6,), np.dtype(np.float64)), 1)
    slab.expected = sys.getrefcount(slab.base)
    return a, b


def lend(a: Planned) -> Any:
    lender = Lender((a,), None)
    (buf,) = lender.take()
    assert buf is a.view
    buf[:] = np.arange(6.0).reshape(2, 3)
    lender.keep([buf], [])
    return buf


def test_a_slab_is_lent_once_its_views_readers_have_acted_and_the_views_are_dropped() -> None:
    a, b = shared(readers=3)  # the transpose's read, the reshape's (of the transpose), the matmul's
    lend(a)
    transpose = watch(lambda step, v: [v[0].T], [Read(0, a, False, (2,))])
    reshape = watch(lambda step, v: [v[0].reshape(6)], [Read(0, a, True, (1,))])  # a copy: .T is not C
    t = transpose(0, [a.view])[0]
    assert t.base is a.slab.base and not a.viewed  # an expected view: the register stays in the plan
    assert Lender((b,), None).take() == (None,)  # two reads left
    r = reshape(0, [t])[0]
    assert r.base is not a.slab.base and a.slab.pending == 0  # the copy's reader reads no slab: off the count
    del t  # the engine drops the transpose once the reshape has read it
    assert Lender((b,), None).take() == (b.view,)
    assert not a.viewed
    np.testing.assert_array_equal(r, np.arange(6.0).reshape(2, 3).T.reshape(6))


def test_a_slab_whose_view_is_alive_is_not_lent_though_every_read_is_counted() -> None:
    a, b = shared(readers=2)
    lend(a)
    kept = watch(lambda step, v: [v[0].reshape(6)], [Read(0, a, False, (1,))])(0, [a.view])[0]
    watch(lambda step, v: [v[0] * 2], [Read(0, a, True, ())])(0, [kept])
    assert a.slab.pending == 0
    assert Lender((b,), None).take() == (None,)  # the view is still alive: never two values in a slab
    del kept
    assert Lender((b,), None).take() == (b.view,)


def test_a_reader_of_a_view_that_views_it_again_unexpectedly_takes_its_value_out_of_the_plan() -> None:
    a, b = shared(readers=2)
    lend(a)
    t = watch(lambda step, v: [v[0].T], [Read(0, a, False, (1,))])(0, [a.view])[0]
    again = watch(lambda step, v: [v[0][1:]], [Read(0, a, True, (None,))])(0, [t])[0]  # not a view op
    assert a.viewed
    del t
    assert Lender((b,), None).take() == (None,)
    del again
    assert Lender((b,), None).take() == (b.view,)


def test_views_of_a_value_the_producer_wrote_elsewhere_are_not_counted() -> None:
    a, b = shared(readers=2)
    fresh = np.ones((2, 3))  # the slab was busy: the producer allocated
    t = watch(lambda step, v: [v[0].T], [Read(0, a, False, (1,))])(0, [fresh])[0]
    watch(lambda step, v: [v[0] + 1], [Read(0, a, True, ())])(0, [t])
    assert a.slab.pending == 0 and Lender((b,), None).take() == (b.view,)


def test_through_the_engine_a_slab_is_not_lent_while_a_view_of_its_value_waits_for_its_reader() -> None:
    """a's value is read through a transpose whose reader acts last; b's producer, sharing a's slab, acts
    before it each step (a plan that misjudged the order): b allocates whenever a's value is in the slab,
    and the reader sees a's value."""
    a, b = shared(readers=2)
    lend_a, lend_b = Lender((a,), None), Lender((b,), None)
    seen: list[float] = []
    lent: list[bool] = []
    lent_a: list[bool] = []

    def produce_a(it: int, xs: list) -> list:
        (buf,) = lend_a.take()
        lent_a.append(buf is not None)
        out = np.empty((2, 3)) if buf is None else buf
        out[:] = it
        lend_a.keep([out], xs)
        return [out]

    def produce_b(it: int, xs: list) -> list:
        (buf,) = lend_b.take()
        lent.append(buf is not None)
        out = np.empty(6) if buf is None else buf
        out[:] = -1.0
        lend_b.keep([out], xs)
        return [out]

    def read(it: int, xs: list) -> list:
        seen.append(float(xs[0].sum()))
        return []

    acts = [
        ActorSpec(0, "a", "compute", (), (0,), produce_a, STEPS, priority=0),
        ActorSpec(
            1,
            "t",
            "compute",
            (0,),
            (1,),
            watch(lambda it, xs: [xs[0].T], [Read(0, a, False, (1,))]),
            STEPS,
            priority=1,
        ),
        ActorSpec(2, "b", "compute", (1,), (2,), produce_b, STEPS, priority=2),
        ActorSpec(
            3,
            "reader",
            "compute",
            (1, 2),
            (),
            watch(watch(read, [Read(0, a, True, ())]), [Read(1, b)]),
            STEPS,
            priority=3,
        ),
    ]
    registers = [RegisterSpec(0, 0, (1,), 1), RegisterSpec(1, 1, (2, 3), 1), RegisterSpec(2, 2, (3,), 1)]
    Engine(acts, registers).run(timeout=10)
    assert seen == [6.0 * i for i in range(STEPS)]
    assert not any(x and y for x, y in zip(lent_a, lent, strict=True))  # b: only where a's value is not
    assert lent_a[0] and not lent[0] and not a.viewed and a.slab.pending == 0


# ---- training: views planned, bit-identical -----------------------------------------------------------------


# the main job unfolded: fused, its attention cores are single ops (6980ce8) and no register of it is a
# view; unfused, no kernel whose output a reader views writes into a lent buffer, so BERT alone checks that
VIEWED = {"main-job": (lambda: unfolded(JOBS["main-job"]()), False), "bert-1x1": (JOBS["bert-1x1"], True)}


@pytest.mark.parametrize("name", list(VIEWED))
def test_values_read_through_views_are_planned_and_train_bit_identically(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, lends = VIEWED[name]
    c = pipeline.compile(make())
    assert c.plan is not None
    d = c.plan.devices[0]
    tensors = plan_tables.of(c.plan, None).tensors
    through = executor_analysis.no_op_boxings(d)
    by_id = {t.id: t for t in d.tasks}
    regs = {r.id: r for r in d.registers}
    viewed = [x for x in memory_plan.lifetimes(d, tensors, frozenset(), through) if x.views]
    ops = {by_id[regs[v].producer_task].op_type for x in viewed for v, _ in x.views}
    assert {"reshape", "transpose"} <= ops  # planned through reshape and transpose ...
    assert any(
        below and by_id[regs[v].producer_task].op_type == "transpose" for x in viewed for v, below in x.views
    )
    chains = [x for x in viewed if len({by_id[regs[v].producer_task].op_type for v, _ in x.views}) > 1]
    assert chains  # ... and through chains of them (a transpose of a reshape)

    on = train(make(), True)
    off = train(make(), False)
    monkeypatch.setattr(memory_plan, "PLAN_VIEWS", False)
    before = train(make(), True)  # the plan as it was: values that readers view left out
    for other in (off, before):
        for x, y in zip(on[0], other[0], strict=True):
            np.testing.assert_array_equal(x, y, err_msg="losses")
        for k in other[1]:
            np.testing.assert_array_equal(on[1][k], other[1][k], err_msg=k)
    memory = on[2].ranks[0].memory
    assert memory is not None and memory.views
    old = before[2].ranks[0].memory
    assert old is not None and not old.views and old.planned_bytes < memory.planned_bytes
    planned = {id(p): p for p in memory.registers.values()}.values()
    with_views = {id(p) for p, _ in memory.views.values()}
    assert not lends or any(
        p.slab.holder is p for p in planned if id(p) in with_views
    )  # a viewed value lent ...
    assert not any(p.viewed for p in planned)  # ... no register left the plan ...
    assert all(p.slab.pending == 0 and not p.slab.retired for p in planned)  # ... every read counted


def test_large_values_start_64_byte_aligned_at_different_offsets_within_a_page() -> None:
    # large values packed one above the other start at one offset within a page: unstaggered, a loop
    # reading one and writing another hits 4K aliasing (BERT's GELU 3x slower)
    places, _ = pack([Lifetime(r, 1 << 22, 0, 1) for r in range(4)])
    starts = [p.start for p in places.values()]
    assert all(a % 64 == 0 for a in starts)
    assert len({a % 4096 for a in starts}) == 4
