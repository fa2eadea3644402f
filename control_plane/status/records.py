"""The store's records as service.proto messages (``JobStatus``, ``JobEvent``, ``LogLine``) and as JSON.

The gRPC servicer and the HTTP status endpoint both answer through these functions, so a job reads
the same on both. A ``JobEvent``'s status is rebuilt from the event itself (state, reason, message)
over the job's current record, carrying forward the step and loss of the events before it: that is
what the job looked like right after the event, without storing a snapshot per event.

Non-finite numbers: a NaN or infinite loss is a double like any other in the messages. JSON has no NaN,
so the JSON spells them as proto3's JSON mapping does, as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` (:func:`as_json` for messages, :func:`json_float` for plain numbers such as the loss
history); every other number stays a number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from sbpflow.control_plane.store.schema import JobEvent, JobRecord, LogRecord, WorkerRecord
from sbpflow.runs.states import WorkerState
from sbpflow.v1 import service_pb2 as sp

if TYPE_CHECKING:
    from sbpflow.control_plane.launch.run_context import RunResult


def timestamp(t: float | None) -> Timestamp | None:
    if t is None:
        return None
    ts = Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


def job_status(rec: JobRecord, workers: Sequence[WorkerRecord] = ()) -> sp.JobStatus:
    """The JobStatus message of a stored job."""
    m = sp.JobStatus(
        job_id=rec.id,
        name=rec.name,
        state=sp.JobState.Value(str(rec.state)),
        reason=rec.reason,
        message=rec.message,
        attempt=rec.attempt,
        step=rec.step,
        total_steps=rec.total_steps,
        samples_per_second=rec.samples_per_second or 0.0,
        created=timestamp(rec.created),
        started=timestamp(rec.started),
        finished=timestamp(rec.finished),
        resumed_from=rec.resumed_from,
        resume_checkpoint=rec.resume_checkpoint,
    )
    add_workers(m, workers)
    if rec.loss is not None:
        m.loss = rec.loss
    if rec.eval_step > 0 and rec.eval_loss is not None:
        m.eval_step, m.eval_loss = rec.eval_step, rec.eval_loss
    if rec.loss_scale is not None:
        m.loss_scale, m.skipped_steps = rec.loss_scale, rec.skipped_steps
    return m


_WORKER_STATES = {s: sp.WorkerState.Value(str(s)) for s in WorkerState}


def add_workers(m: sp.JobStatus, workers: Iterable[WorkerRecord]) -> None:
    """Append a ``WorkerStatus`` row per worker to ``m``, built in place (a 1,024-rank job's rows in
    ~3 ms, not the ~8 ms of a message each with a ``Timestamp`` of its own, merged in)."""
    add = m.workers.add
    for w in workers:
        row = add(
            rank=w.rank, worker_id=w.worker_id, state=_WORKER_STATES[w.state], host=w.host, step=w.step,
            cpu_seconds=w.cpu_seconds, rss_bytes=w.rss_bytes,
        )  # fmt: skip
        row.last_heartbeat.seconds, row.last_heartbeat.nanos = divmod(int(w.last_heartbeat * 1e9), 10**9)


def job_events(
    rec: JobRecord, events: Iterable[JobEvent], before: sp.JobStatus | None = None
) -> Iterator[sp.JobEvent]:
    """JobEvent messages for stored events of ``rec``'s job, in order; ``before`` is the status of the
    event before the first of them (None when replaying from the start)."""
    step, sps = (before.step, before.samples_per_second) if before is not None else (0, 0.0)
    loss: float | None = before.loss if before is not None and before.HasField("loss") else None
    attempt = before.attempt if before is not None else 1  # as of each event: a restart's event says
    for e in events:
        if e.kind == "eval":  # a held-out evaluation: the status page's curve, no JobEvent of its own
            continue
        status = job_status(rec)
        attempt = int(e.data.get("attempt", attempt))  # type: ignore[call-overload]
        status.attempt = attempt
        status.state, status.reason, status.message = sp.JobState.Value(str(e.state)), e.reason, e.message
        out = sp.JobEvent(job_id=e.job_id, seq=e.seq, time=timestamp(e.time))
        if e.kind == "step":
            step = int(e.data["step"])  # type: ignore[call-overload]
            loss = float(e.data["loss"])  # type: ignore[arg-type]
            sps = float(e.data["samples_per_second"])  # type: ignore[arg-type]
            seconds = float(e.data.get("step_seconds", 0.0))  # type: ignore[arg-type]
            out.step.CopyFrom(
                sp.StepMetrics(step=step, loss=loss, samples_per_second=sps, step_seconds=seconds)
            )
            if "loss_scale" in e.data:  # dynamic loss scaling
                out.step.loss_scale = float(e.data["loss_scale"])  # type: ignore[arg-type]
                out.step.skipped_steps = int(e.data["skipped_steps"])  # type: ignore[call-overload]
        else:
            previous = str(e.data.get("from", "JOB_STATE_UNSPECIFIED"))
            out.state_change.CopyFrom(
                sp.StateChange(previous=sp.JobState.Value(previous), current=status.state, reason=e.reason)
            )
        status.step, status.samples_per_second = max(step, 0), sps
        if loss is None:
            status.ClearField("loss")
        else:
            status.loss = loss
        out.status.CopyFrom(status)
        yield out


def log_line(r: LogRecord) -> sp.LogLine:
    return sp.LogLine(job_id=r.job_id, rank=r.rank, time=timestamp(r.time), level=r.level, text=r.text)


def result_proto(job_id: str, result: RunResult, history: Sequence[float] = ()) -> sp.JobResult:
    """The JobResult of a finished run: its losses, its trained parameters (when it kept them) and each
    fetch's last value (within :data:`MAX_FETCH_BYTES`; the others named in ``omitted_fetches``). The
    losses are the job's ``history`` (the store's: every attempt's, a run resumed after a control-plane
    restart included) where it holds at least the run's own."""
    from sbpflow.codec.values import array_to_proto

    losses = list(history) if len(history) >= len(result.losses) else result.losses
    m = sp.JobResult(job_id=job_id, state=sp.JOB_STATE_SUCCEEDED, losses=losses)
    for name, value in (result.parameters or {}).items():
        m.parameters[name].CopyFrom(array_to_proto(_host(value)))
    room = MAX_FETCH_BYTES
    for name, per_step in sorted(result.outputs.items()):  # each fetch's last step
        last = _host(per_step[-1]) if per_step else None
        if last is None or last.nbytes > room:
            m.omitted_fetches.append(name)
            continue
        room -= last.nbytes
        m.fetches[name].CopyFrom(array_to_proto(last))
    return m


MAX_FETCH_BYTES = 32 << 20  # a JobResult's fetches together: the client's messages are at most 64 MiB


def _host(value: Any) -> np.ndarray:
    """A value on this host (a cupy array copied off its device)."""
    return np.asarray(value.get() if hasattr(value, "get") and not isinstance(value, np.ndarray) else value)


def json_float(x: float) -> float | str:
    """``x`` for JSON: itself when finite, else ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (proto3 JSON)."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64}


def as_json(m: Message) -> dict[str, Any]:
    """A message as the JSON the HTTP endpoint serves: proto field names, enums by name, defaults kept,
    and 64-bit integers as numbers (proto3 JSON writes them as strings; steps and ranks read better)."""
    d = json_format.MessageToDict(
        m, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _numbers(m.DESCRIPTOR, d)
    return d


def _numbers(desc: Any, d: dict[str, Any]) -> None:
    for f in desc.fields:
        value = d.get(f.name)
        if value is None:
            continue
        if f.type in _INT64:
            d[f.name] = [int(x) for x in value] if isinstance(value, list) else int(value)
        elif f.message_type is not None:
            for sub in value if isinstance(value, list) else [value]:
                if isinstance(sub, dict):
                    _numbers(f.message_type, sub)
