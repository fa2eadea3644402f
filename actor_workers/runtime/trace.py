"""The execution trace: one event per act, exportable as Chrome trace JSON (open it in ui.perfetto.dev).

Each rank is a process (pid = rank) and each stream a thread of it, so overlap between compute and
communication, and the bubbles of a pipeline, show as gaps and stacked bars.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


def chrome_trace(events: Iterable[ActEvent]) -> dict[str, Any]:
    """Chrome trace JSON: complete events ("X") with ts/dur in microseconds from the first act."""
    events = sorted(events, key=lambda e: e.start)
    t0 = events[0].start if events else 0.0
    tids: dict[tuple[int, str], int] = {}  # Perfetto wants integer tids: number the streams of each rank
    out: list[dict[str, Any]] = []
    for e in events:
        key = (e.rank, e.stream)
        if key not in tids:
            if all(rank != e.rank for rank, _ in tids):
                out.append(_meta("process_name", e.rank, 0, f"rank {e.rank}"))
            tids[key] = sum(rank == e.rank for rank, _ in tids) + 1
            out.append(_meta("thread_name", e.rank, tids[key], e.stream))
        out.append(
            {
                "name": e.name,
                "cat": e.stream,
                "ph": "X",
                "ts": round((e.start - t0) * 1e6, 3),
                "dur": round((e.end - e.start) * 1e6, 3),
                "pid": e.rank,
                "tid": tids[key],
                "args": {"iteration": e.iteration, "actor": e.actor, **e.args},
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[ActEvent], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
