"""The execution trace and its Chrome trace JSON (what Perfetto needs to show streams, acts and overlap)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine
from sbpflow.actor_workers.runtime.group import EngineGroup
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


# ---- a real plan's trace: step markers, send/recv flows, bytes on communication ---------------------------


@pytest.fixture(scope="module")
def pipelined_trace() -> tuple[list, dict]:
    import sbpflow as sf
    from tests.examples.test_examples import load

    job = load("mlp").make_job(ranks=2, pp=2, layers=2, micro_batches=2, steps=3)
    result = sf.run(job, backend="inprocess", trace=True, timeout=120)
    return result.trace, json.loads(json.dumps(chrome_trace(result.trace)))


def test_each_rank_has_a_marker_at_the_start_of_each_step(pipelined_trace: tuple[list, dict]) -> None:
    events, doc = pipelined_trace
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert sorted((e["pid"], e["name"]) for e in marks) == [
        (r, f"step {s}") for r in (0, 1) for s in (1, 2, 3)
    ]
    acts = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for m in marks:  # at the rank's first act of that step
        first = min(
            e["ts"] for e in acts if e["pid"] == m["pid"] and e["args"]["iteration"] == m["args"]["step"] - 1
        )
        assert m["ts"] == first and m["s"] == "p"


def test_every_send_flows_to_its_recv_on_the_peer(pipelined_trace: tuple[list, dict]) -> None:
    events, doc = pipelined_trace
    sends = [e for e in events if e.args.get("comm") == "send"]
    recvs = [e for e in events if e.args.get("comm") == "recv"]
    assert sends and len(sends) == len(recvs)
    flows: dict[int, dict[str, dict]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] in ("s", "f"):
            flows.setdefault(e["id"], {})[e["ph"]] = e
    assert len(flows) == len(sends)  # one arrow per transfer, per micro-batch, per step
    acts = {(e["pid"], e["tid"], e["ts"]): e for e in doc["traceEvents"] if e["ph"] == "X"}
    for f in flows.values():
        s, t = f["s"], f["f"]
        assert s["pid"] != t["pid"] and s["args"]["bytes"] > 0
        send = acts[(s["pid"], s["tid"], s["ts"])]  # starts on the SEND act
        assert send["args"]["comm"] == "send" and send["args"]["peer"] == t["pid"]
        recv = [
            a
            for a in acts.values()
            if a["pid"] == t["pid"] and a["tid"] == t["tid"] and a["ts"] <= t["ts"] <= a["ts"] + a["dur"]
        ]
        assert any(a["args"].get("comm") == "recv" and a["args"]["op"] == send["args"]["op"] for a in recv)


def test_communication_acts_carry_their_bytes(pipelined_trace: tuple[list, dict]) -> None:
    events, _ = pipelined_trace
    comm = [e for e in events if "comm" in e.args]
    assert comm and all(isinstance(e.args["bytes"], int) and e.args["bytes"] >= 0 for e in comm)
    assert all(e.args["bytes"] > 0 for e in comm if e.args["comm"] in ("send", "recv"))
    assert not any("bytes" in e.args for e in events if e.stream == "compute" and "comm" not in e.args)
