"""The actor engine: values, back-pressure, pipelining, loop edges, ordering, failure and timeouts."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.actor_workers.runtime.errors import (
    ActorGraphError,
    RuntimeAborted,
    RuntimeFailure,
    RuntimeTimeout,
)
from sbpflow.actor_workers.runtime.group import EngineGroup


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, f"threads left running: {[t.name for t in left]}"


def noop(it: int, xs: list) -> None:
    return None


def slept(t: float) -> Callable[[int, list], list]:
    """An act that sleeps (releasing the GIL, like a numpy kernel) and passes on its iteration."""

    def act(it: int, xs: list) -> list:
        time.sleep(t)
        return [it]

    return act


def actor(
    i: int, inputs: tuple[int, ...], outputs: tuple[int, ...], fn: Callable, n: int, **kw: Any
) -> ActorSpec:
    return ActorSpec(i, kw.pop("name", f"a{i}"), kw.pop("stream", "compute"), inputs, outputs, fn, n, **kw)


def chain(
    n_actors: int, n: int, count: int = 1, streams: tuple[str, ...] = ("compute",)
) -> tuple[list, list, list]:
    """source -> +1 -> +1 ... -> sink; actor i on streams[i % len]; register i from actor i to i+1."""
    got: list[int] = []
    acts = [actor(0, (), (0,), lambda it, xs: [10 * it], n, stream=streams[0])]
    for i in range(1, n_actors - 1):
        acts.append(actor(i, (i - 1,), (i,), lambda it, xs: [xs[0] + 1], n, stream=streams[i % len(streams)]))
    last = n_actors - 1
    acts.append(
        actor(last, (last - 1,), (), lambda it, xs: got.append(xs[0]), n, stream=streams[last % len(streams)])
    )
    regs = [RegisterSpec(i, i, (i + 1,), count) for i in range(last)]
    return acts, regs, got


@pytest.mark.parametrize("streams", [("compute",), ("compute", "comm"), ("data", "compute", "comm")])
def test_chain_computes_every_value_in_order(streams: tuple[str, ...]) -> None:
    acts, regs, got = chain(6, 50, streams=streams)
    result = Engine(acts, regs, keep_last=(4,)).run(timeout=10)
    assert got == [10 * it + 4 for it in range(50)]
    assert result.acts == 6 * 50
    assert result.last[4] == 10 * 49 + 4


def test_diamond_joins_both_branches() -> None:
    got: list[tuple[int, int]] = []
    acts = [
        actor(0, (), (0,), lambda it, xs: [it], 20),
        actor(1, (0,), (1,), lambda it, xs: [xs[0] * 2], 20, stream="comm"),
        actor(2, (0,), (2,), lambda it, xs: [xs[0] + 100], 20),
        actor(3, (1, 2), (), lambda it, xs: got.append((it, xs[0] + xs[1])), 20),
    ]
    regs = [RegisterSpec(0, 0, (1, 2), 2), RegisterSpec(1, 1, (3,), 1), RegisterSpec(2, 2, (3,), 1)]
    Engine(acts, regs).run(timeout=10)
    assert got == [(it, 3 * it + 100) for it in range(20)]


def live_probe(count: int, n: int) -> tuple[list, list, list[int]]:
    """A fast producer and a slow consumer on two streams; counts values produced and not yet consumed."""
    state = {"made": 0, "done": 0}
    seen: list[int] = []
    lock = threading.Lock()

    def produce(it: int, xs: list) -> list:
        with lock:
            state["made"] += 1
            seen.append(state["made"] - state["done"])
        return [it]

    def consume(it: int, xs: list) -> None:
        time.sleep(0.002)
        with lock:
            state["done"] += 1

    acts = [actor(0, (), (0,), produce, n, stream="data"), actor(1, (0,), (), consume, n)]
    return acts, [RegisterSpec(0, 0, (1,), count)], seen


@pytest.mark.parametrize("count", [1, 2, 3])
def test_back_pressure_bounds_live_values_by_the_register_count(count: int) -> None:
    acts, regs, seen = live_probe(count, 30)
    result = Engine(acts, regs).run(timeout=10)
    assert result.peak_live[0] == count
    assert max(seen) == count  # the producer never ran more than `count` values ahead of the consumer


def test_two_slots_overlap_producer_and_consumer_on_different_streams() -> None:
    """With one slot the producer's next act waits for the consumer's ack: their acts never run at once.
    With two, the producer makes the next value while the consumer works on this one. Checked on the
    acts' intervals, not on total times (a loaded machine stretches those)."""
    t, n = 0.02, 8

    def run(count: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        made: list[tuple[float, float]] = []
        used: list[tuple[float, float]] = []

        def timed(into: list[tuple[float, float]], out: bool) -> Callable[[int, list], list]:
            def act(it: int, xs: list) -> list:
                start = time.monotonic()
                time.sleep(t)  # releases the GIL, like a numpy kernel
                into.append((start, time.monotonic()))
                return [it] if out else []

            return act

        acts = [
            actor(0, (), (0,), timed(made, True), n, stream="data"),
            actor(1, (0,), (), timed(used, False), n),
        ]
        Engine(acts, [RegisterSpec(0, 0, (1,), count)]).run(timeout=60)
        return made, used

    def overlaps(made: list[tuple[float, float]], used: list[tuple[float, float]]) -> int:
        return sum(a < d and c < b for a, b in made for c, d in used)

    assert overlaps(*run(1)) == 0  # one slot: the producer waits for the consumer's ack every time
    assert overlaps(*run(2)) >= 1  # two slots: the next value is made while this one is consumed


def test_loop_edge_with_an_initial_value_updates_a_variable_every_iteration() -> None:
    # variable store 0 reads register 1 (its own update, initially 5.0) and offers it on register 0;
    # the updater 1 adds the iteration number
    reads: list[float] = []

    def store(it: int, xs: list) -> list:
        reads.append(xs[0])
        return [xs[0]]

    acts = [
        actor(0, (1,), (0,), store, 6, initial={1: 5.0}),
        actor(1, (0,), (1,), lambda it, xs: [xs[0] + it], 6, stream="comm"),
    ]
    regs = [RegisterSpec(0, 0, (1,), 1), RegisterSpec(1, 1, (0,), 1)]
    result = Engine(acts, regs, keep_last=(1,)).run(timeout=10)
    assert reads == [5.0, 5.0, 6.0, 8.0, 11.0, 15.0]
    assert result.last[1] == 20.0  # the final value: written by the last update, read by nobody


@pytest.mark.parametrize("kept", [(), (0,)])
def test_a_value_lives_past_its_readers_only_in_a_register_kept_for_the_result(kept: tuple[int, ...]) -> None:
    # the producer sees, at each act, whether its previous value is still alive anywhere
    made: list[weakref.ref] = []
    alive: list[bool] = []

    def produce(it: int, xs: list) -> list:
        alive.append(bool(made) and made[-1]() is not None)
        out = np.full(3, float(it))
        made.append(weakref.ref(out))
        return [out]

    acts = [actor(0, (), (0,), produce, 5), actor(1, (0,), (), lambda it, xs: [], 5)]
    result = Engine(acts, [RegisterSpec(0, 0, (1,), 1)], keep_last=kept).run(timeout=10)
    assert alive == [False] + [bool(kept)] * 4  # read and acked: dropped unless kept
    assert list(result.last) == list(kept)
    if kept:
        assert result.last[0][0] == 4.0


def test_keep_last_names_only_the_engines_registers() -> None:
    acts = [actor(0, (), (0,), lambda it, xs: [it], 2), actor(1, (0,), (), lambda it, xs: [], 2)]
    with pytest.raises(ValueError, match=r"registers \[7\]"):
        Engine(acts, [RegisterSpec(0, 0, (1,), 1)], keep_last=(7,))


def test_a_self_loop_needs_two_slots() -> None:
    acc = actor(0, (0,), (0,), lambda it, xs: [xs[0] + 1], 10, initial={0: 0})
    with pytest.raises(ActorGraphError, match="count 2"):
        Engine([acc], [RegisterSpec(0, 0, (0,), 1)])
    assert Engine([acc], [RegisterSpec(0, 0, (0,), 2)], keep_last=(0,)).run(timeout=5).last[0] == 10


def test_ready_actors_of_one_stream_act_in_priority_order() -> None:
    order: list[str] = []
    acts = [
        actor(i, (), (), lambda it, xs, i=i: order.append(f"p{3 - i}"), 1, priority=3 - i) for i in range(4)
    ]
    Engine(acts, []).run(timeout=5)
    assert order == ["p0", "p1", "p2", "p3"]


def test_an_ordered_stream_keeps_its_order_even_when_a_later_actor_is_ready_first() -> None:
    order: list[tuple[int, int]] = []
    gate = threading.Event()

    def gated(it: int, xs: list) -> list:
        gate.wait(5)
        return [it]

    acts = [
        actor(0, (), (0,), gated, 3, stream="compute"),
        actor(1, (0,), (), lambda it, xs: order.append((1, it)), 3, stream="comm", priority=0),
        actor(2, (), (), lambda it, xs: order.append((2, it)), 3, stream="comm", priority=1),
    ]
    timer = threading.Timer(0.05, gate.set)
    timer.start()
    Engine(acts, [RegisterSpec(0, 0, (1,), 1)], ordered_streams={"comm"}).run(timeout=5)
    timer.join(5)
    assert order == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2)]


def test_a_stream_run_on_another_thread_acts_there_in_priority_order_and_counts_as_itself() -> None:
    """``run_on``: the data actor joins the compute stream's heap and thread; its busy time and trace
    stay the data stream's."""
    where: list[tuple[str, str]] = []

    def act(name: str) -> Callable[[int, list], list]:
        def run(it: int, xs: list) -> list:
            where.append((name, threading.current_thread().name))
            time.sleep(0.001)
            return [it]

        return run

    acts = [
        ActorSpec(0, "load", "data", (), (0,), act("load"), 3),
        ActorSpec(1, "mm", "compute", (0,), (1,), act("mm"), 3, priority=1),
        ActorSpec(2, "out", "compute", (1,), (), lambda it, xs: None, 3, priority=2),
    ]
    regs = [RegisterSpec(0, 0, (1,), 1), RegisterSpec(1, 1, (2,), 1)]
    busy: dict[str, float] = {}
    result = Engine(acts, regs, trace=True, busy=busy, run_on={"data": "compute"}).run(timeout=5)
    assert [n for n, _ in where] == ["load", "mm"] * 3
    assert {t for _, t in where} == {"sbpflow-r0-compute"}
    assert busy["data"] > 0 and busy["compute"] > 0
    assert {(e.name, e.stream) for e in result.trace} == {
        ("load", "data"),
        ("mm", "compute"),
        ("out", "compute"),
    }
    with pytest.raises(ValueError, match="ordered stream"):
        Engine(acts, regs, ordered_streams=("compute",), run_on={"data": "compute"})


@pytest.mark.parametrize(
    ("acts", "regs", "match"),
    [
        ([actor(0, (), (7,), lambda it, xs: [0], 1)], [], "not among the registers"),
        ([actor(0, (), (0,), lambda it, xs: [0], 2), actor(1, (0,), (), noop, 3)], None, "wait forever"),
        ([actor(0, (), (0,), lambda it, xs: [0], 5), actor(1, (0,), (), noop, 3)], None, "slots"),
        ([actor(0, (1,), (0,), noop, 2), actor(1, (0,), (1,), noop, 2)], "cycle", "cycle"),
        ([actor(0, (), (), noop, 1), actor(0, (), (), noop, 1)], [], "used twice"),
    ],
)
def test_graphs_that_would_hang_are_rejected_before_running(acts: list, regs: Any, match: str) -> None:
    if regs is None:
        regs = [RegisterSpec(0, 0, (1,), 1)]
    elif regs == "cycle":
        regs = [RegisterSpec(0, 0, (1,), 1), RegisterSpec(1, 1, (0,), 1)]
    with pytest.raises(ActorGraphError, match=match):
        Engine(acts, regs)


def test_a_failing_act_names_the_rank_the_actor_the_op_and_the_cause() -> None:
    def boom(it: int, xs: list) -> list:
        if it == 3:
            raise ZeroDivisionError("division by zero in the kernel")
        return [it]

    acts = [actor(0, (), (0,), boom, 10, name="matmul.fw#2", op="matmul"), actor(1, (0,), (), noop, 10)]
    with pytest.raises(RuntimeFailure) as info:
        Engine(acts, [RegisterSpec(0, 0, (1,), 1)], rank=3).run(timeout=5)
    f = info.value
    assert (f.rank, f.actor, f.op, f.iteration, type(f.cause)) == (
        3,
        "matmul.fw#2",
        "matmul",
        3,
        ZeroDivisionError,
    )
    assert "rank 3" in str(f) and "matmul.fw#2" in str(f) and "division by zero" in str(f)
    assert f.__cause__ is f.cause


@pytest.mark.parametrize(
    ("value", "match"),
    [([1, 2], "2 values for 1 output"), (np.zeros(1), "a ndarray, not a list of 1 values")],
)
def test_an_act_must_return_a_list_with_one_value_per_output(value: Any, match: str) -> None:
    acts = [actor(0, (), (0,), lambda it, xs: value, 1), actor(1, (0,), (), noop, 1)]
    with pytest.raises(RuntimeFailure, match=match):
        Engine(acts, [RegisterSpec(0, 0, (1,), 1)]).run(timeout=5)


class FakeTransport:
    """Blocks like a recv that waits for a peer, until abort."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.reason = ""

    def recv(self, it: int, xs: list) -> list:
        if self.aborted.wait(30):
            raise ConnectionError(f"transport aborted: {self.reason}")
        return [it]

    def abort(self, reason: str) -> None:
        self.reason = reason
        self.aborted.set()


def test_a_failure_on_one_rank_stops_every_rank_of_a_group_within_two_seconds() -> None:
    transport = FakeTransport()

    def rank_engine(rank: int) -> Engine:
        def work(it: int, xs: list) -> list:
            time.sleep(0.001)
            if rank == 2 and it == 20:
                raise ValueError("shape mismatch (4, 3) vs (4, 5)")
            return [it]

        acts = [
            actor(0, (), (0,), work, 10**6, name=f"gelu@r{rank}", op="gelu"),
            actor(1, (0,), (), lambda it, xs: None, 10**6, stream="comm"),
            actor(2, (), (1,), transport.recv, 10**6, stream="data", name="recv"),
            actor(3, (1,), (), noop, 10**6, stream="data"),
        ]
        regs = [RegisterSpec(0, 0, (1,), 2), RegisterSpec(1, 2, (3,), 1)]
        return Engine(acts, regs, rank=rank)

    group = EngineGroup([rank_engine(r) for r in range(4)], abort_hooks=[transport.abort])
    start = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        group.run(timeout=30)
    assert time.monotonic() - start < 15  # the failure, not the 30 s timeout, ended the group
    assert (info.value.rank, info.value.actor, info.value.op) == (2, "gelu@r2", "gelu")
    assert isinstance(info.value.cause, ValueError)
    assert "gelu@r2" in transport.reason


def test_abort_from_outside_stops_a_running_engine() -> None:
    acts = [actor(0, (), (), lambda it, xs: time.sleep(0.001), 10**6)]
    engine = Engine(acts, [], rank=1)
    timer = threading.Timer(0.1, engine.abort, args=("job cancelled",))
    timer.start()
    with pytest.raises(RuntimeFailure, match="job cancelled") as info:
        engine.run(timeout=10)
    timer.join(5)
    assert isinstance(info.value.cause, RuntimeAborted) and info.value.rank == 1


def test_a_run_that_does_not_finish_raises_a_timeout_naming_what_each_actor_waits_for() -> None:
    # on an ordered stream actor 1 comes first but needs a value that actor 2 (after it) must make first
    acts = [
        actor(0, (), (0,), lambda it, xs: [it], 1, stream="comm", priority=1, name="send"),
        actor(1, (1,), (), noop, 1, stream="comm", priority=0, name="recv"),
        actor(2, (0,), (1,), lambda it, xs: [xs[0]], 1, name="relu"),
    ]
    regs = [RegisterSpec(0, 0, (2,), 1), RegisterSpec(1, 2, (1,), 1)]
    start = time.monotonic()
    with pytest.raises(RuntimeTimeout) as info:
        Engine(acts, regs, ordered_streams={"comm"}).run(timeout=0.3)
    assert time.monotonic() - start < 1.5
    msg = str(info.value)
    assert "'recv'" in msg and "input registers [1]" in msg and "next in order: 'recv'" in msg


def test_a_timeout_calls_the_abort_hooks_so_blocked_acts_end() -> None:
    transport = FakeTransport()
    acts = [actor(0, (), (0,), transport.recv, 1, name="recv"), actor(1, (0,), (), noop, 1)]
    start = time.monotonic()
    with pytest.raises(RuntimeTimeout, match="'recv'.*inside its act"):
        Engine(acts, [RegisterSpec(0, 0, (1,), 1)], abort_hooks=[transport.abort]).run(timeout=0.2)
    assert time.monotonic() - start < 1.5


def test_a_group_times_out_with_the_state_of_every_stalled_rank() -> None:
    transports = [FakeTransport() for _ in range(2)]
    engines = [
        Engine([actor(0, (), (), t.recv, 1, name="recv")], [], rank=r) for r, t in enumerate(transports)
    ]
    with pytest.raises(RuntimeTimeout, match="(?s)engine group.*rank 0.*recv.*rank 1"):
        EngineGroup(engines, abort_hooks=[t.abort for t in transports]).run(timeout=0.2)


def test_an_engine_runs_once() -> None:
    engine = Engine([actor(0, (), (), noop, 0)], [])
    engine.run(timeout=1)
    with pytest.raises(RuntimeError, match="runs once"):
        engine.run(timeout=1)
