"""The one JSON form of a job and its events: the HTTP API (``/v1/jobs``, ``/v1/jobs/{id}``) and every
``--json`` of the CLI (``status``, ``run``, ``run --json-lines``) print these objects, so a script reads
one schema wherever the job comes from.

Version :data:`VERSION` (the ``"version"`` key of every top-level document). Keys stay: a later version
may add keys, never rename or remove one; a change that must is a new version. Version 1 has gained
keys and stays 1: the workers' ``cpu_seconds`` and ``rss_bytes``.

A job::

    {"job_id", "name", "state" ("PENDING" ... "SUCCEEDED", "FAILED", "CANCELLED"), "reason", "message",
     "attempt", "step", "total_steps", "loss" (null before the first step), "samples_per_second",
     "created", "started", "finished" (ISO 8601 UTC, null until then),
     "last_checkpoint", "resumed_from", "resume_checkpoint",
     "workers": [{"rank", "state" ("RUNNING", "DONE", ...), "step", "host", "worker_id",
                  "last_heartbeat", "cpu_seconds", "rss_bytes" (the worker process's CPU seconds and
                  resident bytes at its latest report while the job runs; 0 before it and once ended)}],
     "eval_step" (0 before the first evaluation), "eval_loss" (null then),
     "loss_scale" (null without dynamic loss scaling), "skipped_steps",
     "options": {the run options the job runs under, by name; unset ones absent}}

A list: ``{"version", "jobs": [job, ...]}`` (newest first; ``/v1/jobs?state=RUNNING,PENDING&q=bert&limit=N``
keeps the jobs in those states whose name contains ``q``, ASCII letters in either case, at most 200
printable characters; a bad value is answered 400 ``{"error": ...}`` naming what is allowed); one job:
the job object with ``"version"`` (``/v1/jobs/{id}`` and ``run --json`` add ``"losses"``, every step's
loss). An event (``run --json-lines``):
``{"version", "job_id", "seq", "time", "kind": "step" | "state" | "log", ...}`` with, for a step,
``"step", "loss", "samples_per_second", "step_seconds", "loss_scale", "skipped_steps"``; for a state
change ``"state", "previous", "reason", "message"``; for a log line ``"rank", "level", "text"``.

Non-finite numbers are the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (proto3 JSON's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sbpflow.control_plane.status.records import as_json, json_float
from sbpflow.v1 import service_pb2 as sp

VERSION = 1
JOB_KEYS = (
    "job_id", "name", "state", "reason", "message", "attempt", "step", "total_steps", "loss",
    "samples_per_second", "created", "started", "finished", "last_checkpoint", "resumed_from",
    "resume_checkpoint", "workers", "eval_step", "eval_loss", "loss_scale", "skipped_steps", "options",
)  # fmt: skip
WORKER_KEYS = ("rank", "state", "step", "host", "worker_id", "last_heartbeat", "cpu_seconds", "rss_bytes")


def _time(m: Any, name: str) -> str | None:
    if not m.HasField(name):
        return None
    return str(getattr(m, name).ToDatetime().isoformat(timespec="milliseconds")) + "Z"


def _optional(m: Any, name: str) -> float | str | None:
    return json_float(getattr(m, name)) if m.HasField(name) else None


def _worker(w: sp.WorkerStatus) -> dict[str, Any]:
    return {
        "rank": w.rank,
        "state": sp.WorkerState.Name(w.state).removeprefix("WORKER_STATE_"),
        "step": w.step,
        "host": w.host,
        "worker_id": w.worker_id,
        "last_heartbeat": _time(w, "last_heartbeat"),
        "cpu_seconds": json_float(w.cpu_seconds),
        "rss_bytes": w.rss_bytes,
    }


def job(st: sp.JobStatus) -> dict[str, Any]:
    """A ``JobStatus`` as the job object (without ``"version"``: :func:`document` adds it)."""
    return {
        "job_id": st.job_id,
        "name": st.name,
        "state": sp.JobState.Name(st.state).removeprefix("JOB_STATE_"),
        "reason": st.reason,
        "message": st.message,
        "attempt": st.attempt,
        "step": st.step,
        "total_steps": st.total_steps,
        "loss": _optional(st, "loss"),
        "samples_per_second": json_float(st.samples_per_second),
        **{k: _time(st, k) for k in ("created", "started", "finished")},
        "last_checkpoint": st.last_checkpoint,
        "resumed_from": st.resumed_from,
        "resume_checkpoint": st.resume_checkpoint,
        "workers": [_worker(w) for w in st.workers],
        "eval_step": st.eval_step,
        "eval_loss": _optional(st, "eval_loss"),
        "loss_scale": _optional(st, "loss_scale"),
        "skipped_steps": st.skipped_steps,
        "options": as_json(st.options) if st.HasField("options") else {},
    }


def document(st: sp.JobStatus, losses: Iterable[float] | None = None) -> dict[str, Any]:
    """One job as a top-level document; with ``losses``, every step's loss too."""
    doc = {"version": VERSION, **job(st)}
    if losses is not None:
        doc["losses"] = [json_float(x) for x in losses]
    return doc


def jobs(statuses: Iterable[sp.JobStatus]) -> dict[str, Any]:
    return {"version": VERSION, "jobs": [job(st) for st in statuses]}


def event(ev: sp.JobEvent) -> dict[str, Any]:
    """A ``JobEvent`` as the event object."""
    doc: dict[str, Any] = {"version": VERSION, "job_id": ev.job_id, "seq": ev.seq, "time": _time(ev, "time")}
    kind = ev.WhichOneof("detail")
    if kind == "step":
        s = ev.step
        return doc | {
            "kind": "step",
            "step": s.step,
            "loss": json_float(s.loss),
            "samples_per_second": json_float(s.samples_per_second),
            "step_seconds": json_float(s.step_seconds),
            "loss_scale": _optional(s, "loss_scale"),
            "skipped_steps": s.skipped_steps,
        }
    if kind == "state_change":
        c = ev.state_change
        name = sp.JobState.Name
        return doc | {
            "kind": "state",
            "state": name(c.current).removeprefix("JOB_STATE_"),
            "previous": name(c.previous).removeprefix("JOB_STATE_"),
            "reason": c.reason,
            "message": ev.status.message,
        }
    line = ev.log
    return doc | {"kind": "log", "rank": line.rank, "level": line.level, "text": line.text}
