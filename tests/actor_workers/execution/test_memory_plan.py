"""The memory plan: registers whose lifetimes do not overlap share a buffer, lent only when it is dead.

The packing is checked on its own (never two overlapping lifetimes on one byte, a kernel's input and
output apart, tighter than a buffer per colour); the run-time checks with the engine's real references
(a value read after its plan lifetime, a view of a lent buffer, an identity reader, a value the plan's
order did not foresee, a value on bytes another slab's live value holds); and the main job, GPT, BERT
and ResNet trained with the plan on and off give bit-identical losses and parameters.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numba
import numpy as np
import pytest

from sbpflow.actor_workers.execution import executor, executor_analysis, memory_plan, plan_tables
from sbpflow.actor_workers.execution.memory_pack import Lifetime, pack
from sbpflow.actor_workers.execution.memory_plan import Lender, Planned, Slab, watch
from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.control_plane.compiler import pipeline
from sbpflow.job import Job, LossScaling
from sbpflow.v1 import plan_pb2 as pp
from tests.actor_workers.test_equivalence import gpt_job
from tests.control_plane.compiler.test_loss_scaling import fp16
from tests.examples.test_examples import load

STEPS = 4


# ---- the packing ----------------------------------------------------------------------------------------


def test_lifetimes_that_overlap_never_share_a_byte() -> None:
    rng = np.random.default_rng(0)
    lives = []
    for r in range(200):
        first = int(rng.integers(0, 100))
        n = int(rng.integers(1, 5)) * 64 + int(rng.integers(0, 2)) * 20000  # some staggered
        lives.append(Lifetime(r, n, first, first + int(rng.integers(0, 10))))
    places, size = pack(lives)
    assert set(places) == {x.register for x in lives}
    for a in lives:
        p = places[a.register]
        assert p.start % 64 == 0 and p.nbytes == a.nbytes and p.start + p.nbytes <= p.end <= size
        for b in lives:
            if a is not b and places[a.register].meets(places[b.register]):
                assert not a.overlaps(b), (a, b)
    assert size < sum(x.nbytes for x in lives)  # it does share


def test_an_input_and_the_output_of_one_act_never_share() -> None:
    # x (0 -> 1) is read by the act that writes y (1 -> 2): both live at position 1
    places, size = pack([Lifetime(0, 64, 0, 1), Lifetime(1, 64, 1, 2), Lifetime(2, 64, 2, 3)])
    assert not places[0].meets(places[1]) and not places[1].meets(places[2])
    assert places[0] == places[2] and size == 128


def test_two_values_take_the_place_of_a_larger_one_that_died() -> None:
    # a buffer per colour needs a's 128 bytes plus one for c (b and c live together): 192; packed, b and
    # c lie on a's bytes, half each
    places, size = pack([Lifetime(0, 128, 0, 1), Lifetime(1, 64, 2, 3), Lifetime(2, 64, 2, 3)])
    assert size == 128 and places[1].meets(places[0]) and places[2].meets(places[0])


# ---- the run-time checks -----------------------------------------------------------------------------


@numba.njit(cache=False)
def _numba_tail(x: Any) -> Any:
    return x[1:]


def shared(readers: int = 1) -> tuple[Planned, Planned]:
    """Two registers planned into one slab, as :func:`memory_plan.plan` makes them."""
    slab = Slab(32)
    a = Planned(slab, slab.view((4,), np.dtype(np.float64)), readers)
    b = Planned(slab, slab.view((2, 2), np.dtype(np.float64)), readers)
    slab.expected = sys.getrefcount(slab.base)
    return a, b


def meeting_slabs() -> tuple[Planned, Planned]:
    """Two registers whose slabs share 16 of their 32 bytes on one arena, as :func:`memory_plan.plan`
    makes them for values that never live together."""
    arena = memoryview(np.empty(64, np.uint8))
    sa, sb = (Slab(32, np.frombuffer(arena[i : i + 32], np.uint8)) for i in (0, 16))
    sa.meets, sb.meets = (sb,), (sa,)
    a, b = (Planned(s, s.view((4,), np.dtype(np.float64)), 1) for s in (sa, sb))
    for s in (sa, sb):
        s.expected = sys.getrefcount(s.base)
        s.siblings = frozenset({id(sa.base), id(sb.base)})
    return a, b


def test_a_slab_is_not_lent_while_a_slab_its_bytes_meet_holds_a_live_value() -> None:
    a, b = meeting_slabs()
    lend_a, lend_b = Lender((a,), None), Lender((b,), None)
    assert Lender((a, b), None).take() == (a.view, b.view)  # nothing written yet: both free
    (buf,) = lend_a.take()
    buf[:] = 1.0
    lend_a.keep([buf], [])
    assert lend_b.take() == (None,)  # a's value, unread, is on half of b's bytes
    assert Lender((None, b), None).take() == (None, None)
    kept = watch(lambda step, values: [values[0][1:]], [(0, a)])(0, [a.view])  # read, a view kept
    assert lend_b.take() == (None,)  # a view of a's value still on b's bytes
    del kept
    assert lend_b.take() == (b.view,)
    b.view[:] = 2.0
    lend_b.keep([b.view], [])
    assert lend_a.take() == (None,)  # and the other way round


@pytest.mark.parametrize(
    ("layout", "own"),
    [
        (lambda buf: buf[::-1], True),  # its shape and dtype in its own layout (attention's heads inside)
        (lambda buf: buf[:2], False),  # part of it: not the register's value as the plan sees it
    ],
)
def test_a_kernels_own_view_of_its_lent_bytes_occupies_them(layout: Any, own: bool) -> None:
    # attention returns its lent [B, H, T, D] buffer's bytes as a [B, T, H, D]-laid view: not the lent
    # array, yet a live value on it (the slab was taken as empty, and a slab meeting it was lent over it)
    a, b = meeting_slabs()
    lend_a, lend_b = Lender((a,), None), Lender((b,), None)
    (buf,) = lend_a.take()
    out = layout(buf)
    out[:] = 1.0
    lend_a.keep([out], [])
    del buf
    assert lend_b.take() == (None,)  # a's value, unread, is on half of b's bytes
    if own:  # the plan lends that array from then on, and counts its reads
        assert a.view is out and a.slab.pending == 1
        watch(lambda step, values: [values[0] * 2], [(0, a)])(0, [out])
    del out
    assert lend_b.take() == (b.view,)
    assert a.slab.pending == 0


def test_an_array_on_another_slab_of_the_plan_leaves_a_slab_in_service_one_on_its_memory_does_not() -> None:
    # untracked() asks numpy only about arrays on no slab of the plan (Slab.siblings): an output written
    # into another slab is that slab's value (where their bytes meet, Slab.meets keeps them apart in time)
    a, _ = shared()
    other = Slab(32)
    a.slab.siblings = other.siblings = frozenset({id(a.slab.base), id(other.base)})
    memory_plan.untracked(other.view((4,), np.dtype(np.float64)), a.slab)
    assert not a.slab.retired
    memory_plan.untracked(
        np.frombuffer(memoryview(a.view), np.float64), a.slab
    )  # its memory, not via its owner
    assert a.slab.retired


def test_a_slab_is_lent_only_once_every_read_of_its_value_is_done() -> None:
    a, b = shared(readers=2)
    lend_a, lend_b = Lender((a,), None), Lender((b,), None)
    (buf,) = lend_a.take()
    assert buf is a.view
    buf[:] = 1.0
    lend_a.keep([buf], [])
    assert lend_b.take() == (None,)  # a's value awaits two reads
    reader = watch(lambda step, values: [values[0] * 2], [(0, a)])
    reader(0, [a.view])
    assert lend_b.take() == (None,)  # one read left: a value read after its plan lifetime stays intact
    reader(0, [a.view])
    assert lend_b.take() == (b.view,)


def test_a_view_of_a_lent_buffer_keeps_it() -> None:
    a, b = shared()
    lend_a, lend_b = Lender((a,), None), Lender((b,), None)
    lend_a.keep([lend_a.take()[0]], [])
    kept = watch(lambda step, values: [values[0][1:]], [(0, a)])(0, [a.view])  # a reader's view
    assert lend_b.take() == (None,)
    del kept
    assert lend_b.take() == (b.view,)


@pytest.mark.parametrize(
    "passes_on",
    [
        lambda x: x,  # the value itself
        lambda x: np.asarray(memoryview(x)),  # an array on a memoryview of it
        lambda x: _numba_tail(x),  # numba's view of its input: its base a MemInfo, not the slab
    ],
)
def test_a_reader_that_returns_the_value_itself_retires_the_slab(passes_on: Any) -> None:
    a, b = shared()
    lend_a = Lender((a,), None)
    lend_a.keep([lend_a.take()[0]], [])
    out = watch(lambda step, values: [passes_on(values[0])], [(0, a)])(0, [a.view])
    assert a.slab.retired and Lender((b,), None).take() == (None,)
    del out
    assert Lender((b,), None).take() == (None,)  # for good


def test_a_kernel_that_returns_numbas_view_of_its_lent_buffer_retires_the_slab() -> None:
    a, b = shared()
    lend_a = Lender((a,), None)
    (buf,) = lend_a.take()
    lend_a.keep([_numba_tail(buf)], [])  # on the slab, but its base is numba's, not the slab's owner
    assert a.slab.retired and Lender((b,), None).take() == (None,)


def test_a_value_the_kernel_did_not_write_into_the_slab_does_not_occupy_it() -> None:
    a, b = shared()
    lend_a = Lender((a,), None)
    assert lend_a.take() == (a.view,)
    lend_a.keep([np.zeros(4)], [])  # the kernel allocated: nothing in the slab
    assert Lender((b,), None).take() == (b.view,)


def test_a_wrong_plan_through_the_engine_still_never_puts_two_live_values_in_one_slab() -> None:
    """Two registers whose values one reader reads together (their lifetimes overlap) put in one slab, as
    a plan that misjudged the engine's order would: the run-time check lends the slab only once its value
    is dead, the other producer allocates, and every value read is the one written."""
    a, b = shared()
    lend_a, lend_b = Lender((a,), None), Lender((b,), None)
    seen: list[tuple[int, float, float]] = []
    lent: list[bool] = []

    def produce_a(it: int, xs: list) -> list:
        (buf,) = lend_a.take()
        out = np.empty(4) if buf is None else buf
        out[:] = it
        lend_a.keep([out], xs)
        return [out]

    def produce_b(it: int, xs: list) -> list:  # runs before a's reader (a higher priority)
        (buf,) = lend_b.take()
        lent.append(buf is not None)
        out = np.empty((2, 2)) if buf is None else buf
        out[:] = -it
        lend_b.keep([out], xs)
        return [out]

    def read(it: int, xs: list) -> list:
        seen.append((it, float(xs[0][0]), float(np.asarray(xs[1]).ravel()[0])))
        return []

    acts = [
        ActorSpec(0, "a", "compute", (), (0,), produce_a, STEPS, priority=0),
        ActorSpec(1, "b", "compute", (), (1,), produce_b, STEPS, priority=1),
        ActorSpec(
            2, "reader", "compute", (0, 1), (), watch(watch(read, [(0, a)]), [(1, b)]), STEPS, priority=2
        ),
    ]
    Engine(acts, [RegisterSpec(0, 0, (2,), 1), RegisterSpec(1, 1, (2,), 1)]).run(timeout=10)
    assert seen == [(i, float(i), float(-i)) for i in range(STEPS)]
    assert not all(lent)  # b's producer was refused the slab a's live value held


def test_a_register_whose_value_a_reader_views_leaves_the_plan() -> None:
    a, b = shared()
    lend_a, lend_b = Lender((a,), None), Lender((b,), None)
    lend_a.keep([lend_a.take()[0]], [])
    kept = watch(lambda step, values: [values[0].reshape(2, 2)], [(0, a)])(0, [a.view])
    assert a.viewed  # its next value goes into a fresh array ...
    assert lend_a.take() == (None,) and lend_b.take() == (None,)  # ... and the slab is held ...
    del kept
    assert lend_b.take() == (b.view,)  # ... until the view is dropped


def unfolded(job: Any) -> Any:
    """``job`` without the compiler's fusion, whose attention-core fold (6980ce8) makes one op of each
    attention and its heads' reshapes and transposes: the reshapes stay ops of their own."""
    return dataclasses.replace(job, config=dataclasses.replace(job.config, fusion=False))


def test_values_someone_keeps_past_an_act_are_not_planned() -> None:
    c = pipeline.compile(unfolded(JOBS["main-job"]()))
    assert c.plan is not None
    device = c.plan.devices[0]
    tables = plan_tables.of(c.plan, None)
    planned = memory_plan.plan(device, tables.tensors, frozenset()).registers
    by_id = {t.id: t for t in device.tasks}
    kept = [r for r in device.registers if any(by_id[t].kind == pp.TASK_KIND_SINK for t in r.consumer_tasks)]
    assert kept and not any(r.id in planned for r in kept)  # the loss a fetch records, what assigns store
    views = [r for r in device.registers if by_id[r.producer_task].op_type == "reshape"]
    assert views and not any(r.id in planned for r in views)  # a view has no bytes of its own
    for r in device.registers:
        if r.id in planned:
            assert {by_id[t].kind for t in r.consumer_tasks} <= set(memory_plan.READERS)


def test_a_value_read_through_boxings_that_move_nothing_is_planned_for_their_readers() -> None:
    # BERT on a 1 x 1 mesh: 2-d boxings that move nothing stand between many kernels; the executor
    # bypasses them, so the kernels after them read the value itself, and the plan counts them
    c = pipeline.compile(JOBS["bert-1x1"]())
    assert c.plan is not None
    device = c.plan.devices[0]
    tensors = plan_tables.of(c.plan, None).tensors
    position = {t.id: i for i, t in enumerate(device.tasks)}
    regs = {r.id: r for r in device.registers}
    through = executor_analysis.no_op_boxings(device)
    direct = {life.register for life in memory_plan.lifetimes(device, tensors)}
    aliased = [life for life in memory_plan.lifetimes(device, tensors, through=through) if life.aliases]
    assert aliased and not any(life.register in direct for life in aliased)
    for life in aliased:
        for alias in life.aliases:  # a bypassed step's register: its readers are within the lifetime
            assert regs[alias].producer_task in through
            assert all(position[t] <= life.last for t in regs[alias].consumer_tasks)
    planned = memory_plan.plan(device, tensors, frozenset(), through).registers
    assert all(planned[a] is planned[life.register] for life in aliased for a in life.aliases)


# ---- training: bit-identical with the plan on and off -----------------------------------------------


def train(job: Job, plan_memory: bool) -> tuple[list[Any], dict[str, Any], executor.Program]:
    c = pipeline.compile(job)
    assert c.plan is not None, c.notes
    ranks = [d.rank for d in c.plan.devices]
    with InProcessWorld(ranks, timeout=60.0) as world:
        transports = {r: world.transport(r) for r in ranks}
        program = executor.build(c.plan, STEPS, transports, plan_memory=plan_memory)
        executor.execute(program, 60.0, abort_hooks=[world.abort])
    names = [p.tensor for p in job.parameters]
    return executor.fetched(program, job.loss, STEPS), executor.variables(program, names), program


JOBS = {
    "main-job": lambda: load("charlm").make_job(
        ranks=1, layers=2, heads=4, width=64, seq_len=64, steps=STEPS
    ),
    "gpt-1": lambda: gpt_job(ranks=1, steps=STEPS),
    "bert-1x1": lambda: load("bert").make_job(ranks=1, dp=1, batch_size=8, steps=STEPS, lr=1e-2),
    # convolutions, batch norm, max pooling and SGD's momentum, their values packed on shared bytes
    "resnet-1": lambda: load("resnet").make_job(ranks=1, width=4, image_size=8, batch_size=4, steps=STEPS),
    "gpt-dp2-unfused": lambda: dataclasses.replace(
        gpt_job(ranks=2, steps=STEPS), config=dataclasses.replace(gpt_job(ranks=2).config, fusion=False)
    ),
    # fp16 with steps skipped (inf and NaN in the gradients), ZeRO-3's gathers and reduce-scatters on the
    # transport thread: attention's outputs, views of their lent bytes, were lent over (1 run in 3 failed)
    "gpt-dp2-zero3-fp16": lambda: fp16(
        load("gpt").make_job(ranks=2, steps=STEPS), LossScaling(2.0**20, growth_interval=2), zero_stage=3
    ),
}


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every planned buffer is filled with NaN as it is lent: a live value on bytes lent too early, or a
    kernel that reads its lent buffer before it writes it, shows in the losses and parameters."""
    take = Lender.take

    def poisoning(self: Lender) -> tuple[Any, ...]:
        lent = take(self)
        for view, p in zip(lent, self.planned, strict=True):
            if view is not None and p is not None and view.dtype.kind == "f":
                view.fill(np.nan)
        return lent

    monkeypatch.setattr(Lender, "take", poisoning)


@pytest.mark.parametrize("name", list(JOBS))
def test_training_is_bit_identical_with_the_plan_on_and_off(name: str, poisoned: None) -> None:
    job = JOBS[name]()
    on_losses, on_vars, program = train(job, True)
    off_losses, off_vars, _ = train(job, False)
    for x, y in zip(on_losses, off_losses, strict=True):
        np.testing.assert_array_equal(x, y, err_msg="losses")
    for k in off_vars:
        np.testing.assert_array_equal(on_vars[k], off_vars[k], err_msg=k)
    memory = program.ranks[0].memory
    assert memory is not None and memory.registers  # registers were planned ...
    assert memory.slab_bytes < memory.planned_bytes  # ... share ...
    planned = memory.registers.values()
    assert any(p.slab.holder is not None for p in planned)  # ... were lent ...
    assert all(p.slab.pending == 0 for p in planned)  # ... and every value lent was read as often as planned
