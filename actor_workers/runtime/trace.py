"""The execution trace: one event per act, exportable as Chrome trace JSON (open it in ui.perfetto.dev).

Each rank is a process (pid = rank) and each stream a thread of it, so overlap between compute and
communication, and the bubbles of a pipeline, show as gaps and stacked bars. On top of the acts:

- a **step marker** per rank and step, an instant event ``step N`` where that rank's first act of the
  step began (a line across the rank's streams);
- a **flow arrow** from each SEND to the RECV that takes its register on the peer rank (matched by the
  boxing op, the micro-batch, the pair of ranks and the step);
- **bytes** on every communication act: ``args.bytes`` (a SEND's or RECV's register, a collective's
  bytes moved per the cost table), with its collective and peer (:func:`task_args`, from the plan).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sbpflow.v1 import plan_pb2 as pp

_COMM_KINDS = {pp.TASK_KIND_SEND: "send", pp.TASK_KIND_RECV: "recv", pp.TASK_KIND_BOXING: "boxing"}
_COLLECTIVES = {v: k.removeprefix("COLLECTIVE_KIND_").lower() for k, v in pp.CollectiveKind.items()}


@dataclass(frozen=True, slots=True)
class ActEvent:
    """One act: actor id and name, its stream and iteration, start and end in seconds (perf_counter)."""

    actor: int
    name: str
    stream: str
    iteration: int
    start: float
    end: float
    thread: str
    rank: int = 0
    args: Mapping[str, Any] = field(default_factory=dict)


def task_args(task: pp.Task, registers: Mapping[int, pp.RegisterDesc]) -> dict[str, Any]:
    """What the trace shows of a task beside its act: the micro-batch and task id, and for a SEND, RECV
    or boxing its kind, op, collective, peer and bytes (a register's for point to point, else the bytes
    the collective moves)."""
    args: dict[str, Any] = {"micro_batch": task.micro_batch, "task": task.id}
    kind = _COMM_KINDS.get(task.kind)
    if kind is None:
        return args
    if kind == "send" and task.in_registers:
        moved = registers[task.in_registers[0]].bytes
    elif kind == "recv" and task.out_registers:
        moved = registers[task.out_registers[0]].bytes
    else:
        moved = task.boxing.bytes_moved
    args.update(comm=kind, op=task.op_name, collective=_COLLECTIVES[task.boxing.collective], bytes=moved)
    if kind != "boxing":
        args["peer"] = task.boxing.peer
    return args


def chrome_trace(events: Iterable[ActEvent]) -> dict[str, Any]:
    """Chrome trace JSON: complete events ("X") with ts/dur in microseconds from the first act, a step
    marker ("i") per rank and step, and a flow ("s" to "f") from each SEND to its RECV."""
    events = sorted(events, key=lambda e: e.start)
    t0 = events[0].start if events else 0.0
    tids: dict[tuple[int, str], int] = {}  # Perfetto wants integer tids: number the streams of each rank
    out: list[dict[str, Any]] = []
    first: dict[tuple[int, int], ActEvent] = {}  # (rank, iteration) -> its first act
    for e in events:
        key = (e.rank, e.stream)
        if key not in tids:
            if all(rank != e.rank for rank, _ in tids):
                out.append(_meta("process_name", e.rank, 0, f"rank {e.rank}"))
            tids[key] = sum(rank == e.rank for rank, _ in tids) + 1
            out.append(_meta("thread_name", e.rank, tids[key], e.stream))
        first.setdefault((e.rank, e.iteration), e)
        out.append(
            {
                "name": e.name,
                "cat": e.stream,
                "ph": "X",
                "ts": _us(e.start, t0),
                "dur": round((e.end - e.start) * 1e6, 3),
                "pid": e.rank,
                "tid": tids[key],
                "args": {"iteration": e.iteration, "actor": e.actor, **e.args},
            }
        )
    for (rank, it), e in sorted(first.items()):
        out.append(
            {"name": f"step {it + 1}", "cat": "step", "ph": "i", "s": "p", "ts": _us(e.start, t0), "pid": rank,
             "tid": tids[(rank, e.stream)], "args": {"step": it + 1}}
        )  # fmt: skip
    out.extend(_flows(events, tids, t0))
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _flows(events: list[ActEvent], tids: dict[tuple[int, str], int], t0: float) -> list[dict[str, Any]]:
    """A flow from the start of each SEND to the end of the matching RECV, where the register arrives (a
    RECV begins waiting early; Chrome's legacy flow events, which Perfetto draws as arrows)."""
    sends: dict[tuple[Any, ...], ActEvent] = {}
    out: list[dict[str, Any]] = []
    for e in events:
        if e.args.get("comm") == "send":
            sends[(e.args["op"], e.args["micro_batch"], e.rank, e.args["peer"], e.iteration)] = e
    for n, e in enumerate(x for x in events if x.args.get("comm") == "recv"):
        s = sends.get((e.args["op"], e.args["micro_batch"], e.args["peer"], e.rank, e.iteration))
        if s is None:
            continue
        flow = {"name": f"{s.args['bytes']} B", "cat": "p2p", "id": n + 1, "args": {"bytes": s.args["bytes"]}}
        start = {"ts": _us(s.start, t0), "pid": s.rank, "tid": tids[(s.rank, s.stream)]}
        arrives = max(_us(e.start, t0), _us(e.end, t0) - 0.001)  # inside the RECV, as its wait ends
        end = {"ts": arrives, "pid": e.rank, "tid": tids[(e.rank, e.stream)]}
        out += [{**flow, "ph": "s", **start}, {**flow, "ph": "f", "bp": "e", **end}]
    return out


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def write_chrome_trace(events: Iterable[ActEvent], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
