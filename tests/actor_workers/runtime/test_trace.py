"""The execution trace and its Chrome trace JSON (what Perfetto needs to show streams, acts and overlap)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sbpflow.actor_workers.runtime.actor import ActorSpec
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.actor_workers.runtime.group import EngineGroup
from sbpflow.actor_workers.runtime.register import RegisterSpec
from sbpflow.actor_workers.runtime.trace import chrome_trace, write_chrome_trace


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


def slept(t: float) -> Callable[[int, list], list]:
    def act(it: int, xs: list) -> list:
        time.sleep(t)
        return [it]

    return act


def pipeline(rank: int, count: int, n: int = 4, t: float = 0.01) -> Engine:
    acts = [
        ActorSpec(
            0,
            "load",
            "data",
            (),
            (0,),
            slept(t),
            n,
            trace_args={"micro_batch": 0},
        ),
        ActorSpec(1, "matmul", "compute", (0,), (), lambda it, xs: time.sleep(t), n, op="matmul"),
    ]
    return Engine(acts, [RegisterSpec(0, 0, (1,), count)], trace=True, rank=rank)


def test_every_act_is_one_event_with_its_stream_iteration_and_times() -> None:
    result = pipeline(0, 2).run(timeout=5)
    assert len(result.trace) == 8
    assert sorted((e.name, e.iteration) for e in result.trace) == sorted(
        [("load", i) for i in range(4)] + [("matmul", i) for i in range(4)]
    )
    for e in result.trace:
        assert e.end >= e.start and e.stream == {"load": "data", "matmul": "compute"}[e.name]
        assert e.thread == f"sbpflow-r0-{e.stream}"
    loads = {e.iteration: e for e in result.trace if e.name == "load"}
    for e in result.trace:
        if e.name == "matmul":  # a consumer acts after its producer made the value
            assert e.start >= loads[e.iteration].end


def test_an_engine_without_trace_records_nothing() -> None:
    acts = [ActorSpec(0, "a", "compute", (), (), lambda it, xs: None, 3)]
    assert Engine(acts, []).run(timeout=5).trace == []


def test_chrome_trace_has_what_perfetto_needs(tmp_path: Path) -> None:
    results = EngineGroup([pipeline(0, 2), pipeline(1, 1)]).run(timeout=5)
    events = [e for r in results.values() for e in r.trace]
    doc = json.loads(write_chrome_trace(events, tmp_path / "trace.json").read_text())
    assert doc == json.loads(json.dumps(chrome_trace(events)))
    acts = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(acts) == 16
    for e in acts:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert e["ts"] >= 0 and e["dur"] >= 0
        assert e["args"]["iteration"] in range(4)
    assert min(e["ts"] for e in acts) == 0
    assert {e["pid"] for e in acts} == {0, 1}  # pid = rank
    assert all(e["args"]["micro_batch"] == 0 for e in acts if e["name"] == "load")
    names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"
    }
    assert sorted(names.values()) == ["compute", "compute", "data", "data"]  # tid = stream, named
    assert all(names[e["pid"], e["tid"]] == e["cat"] for e in acts)
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}


def test_the_trace_shows_overlap_with_two_slots_and_none_with_one() -> None:
    def overlap(count: int) -> float:
        trace = pipeline(0, count, n=6, t=0.02).run(timeout=5).trace
        loads = [e for e in trace if e.stream == "data"]
        mms = [e for e in trace if e.stream == "compute"]
        return sum(max(0.0, min(a.end, b.end) - max(a.start, b.start)) for a in loads for b in mms)

    assert overlap(1) < 0.01
    assert overlap(2) > 0.04
