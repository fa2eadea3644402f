"""A job's own status page (``/jobs/{id}``): what went wrong first, then the curves, the workers, the
checkpoints, the events and the log, then what the job is (its configuration and its plan).

:class:`JobView` is everything the page shows, gathered by the HTTP endpoint from the store, the job
manager and the plan cache; :func:`page` only formats it. The parts that change while a job runs carry
``data-live`` (``web.py`` refreshes them); the configuration and the plan picture do not, so a block
opened in the picture stays open.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from sbpflow.checkpoint.read import CheckpointInfo
from sbpflow.control_plane.status.charts import Marker, Series, fmt, line_chart
from sbpflow.control_plane.status.curves import counted, learning_rates
from sbpflow.control_plane.status.web import (
    TERMINAL,
    badge,
    esc,
    frame,
    held_out,
    ran_for,
    table,
    when,
)
from sbpflow.control_plane.store.schema import JobEvent, JobRecord, LogRecord, WorkerRecord
from sbpflow.job import Job
from sbpflow.runs.states import JobState

LOG_TAIL = 60  # log lines on the page (the whole log: sbpflow logs ID)
EVENT_TAIL = 100  # state and reason events on the page
_CURVES = frozenset({"step", "eval"})  # events the curves draw, not listed


@dataclass(frozen=True)
class JobView:
    """What a job's page shows."""

    rec: JobRecord
    job: Job | None  # None when the stored Job no longer decodes (an older format)
    workers: Sequence[WorkerRecord]
    events: Sequence[JobEvent]
    logs: Sequence[LogRecord]
    checkpoints: Sequence[CheckpointInfo]
    plan_summary: str  # Compiled.summary(), or why there is none
    plan_picture: str  # an HTML fragment (plan_picture.picture), or ""


def page(v: JobView, signed_in: bool) -> str:
    r = v.rec
    body = (
        f"<h1>{esc(r.name)} <small>{esc(r.id)}</small></h1>"
        f"<div id='overview' data-live>{_overview(v)}</div>"
        f"<div id='failure' data-live>{_failure(v)}</div>"
        f"<h2>Curves</h2><div id='curves' class='charts' data-live>{_curves(v)}</div>"
        f"<h2>Workers</h2><div id='workers' data-live>{_workers(v.workers)}</div>"
        f"<h2>Checkpoints</h2><div id='checkpoints' data-live>{_checkpoints(v.checkpoints)}</div>"
        f"<h2>Events</h2><div id='events' data-live>{_events(v.events)}</div>"
        f"<h2>Log</h2><div id='log' data-live>{_log(v.logs)}</div>"
        f"<h2>Configuration</h2>{_configuration(v.job)}"
        f"<h2>Plan</h2><pre id='plan-summary'>{esc(v.plan_summary)}</pre>{v.plan_picture}"
        f"<p>JSON: <a href='/v1/jobs/{esc(r.id)}'>/v1/jobs/{esc(r.id)}</a> · the plan alone: "
        f"<a href='/jobs/{esc(r.id)}/plan'>/jobs/{esc(r.id)}/plan</a></p>"
    )
    return frame(f"sbpflow: {r.name} {r.id}", body, final=r.state in TERMINAL, signed_in=signed_in)


def _overview(v: JobView) -> str:
    r = v.rec
    cells = [
        ("state", f"{badge(r.state)} {esc(r.reason)}"),
        ("step", f"{r.step} of {r.total_steps}"),
        ("loss", "" if r.loss is None else esc(fmt(r.loss))),
        ("held-out loss", held_out(r)),
        ("samples/s", "" if not r.samples_per_second else esc(fmt(r.samples_per_second))),
        ("attempt", str(r.attempt)),
        ("created", esc(when(r.created))),
        ("started", esc(when(r.started))),
        ("finished", esc(when(r.finished))),
        ("ran for", esc(ran_for(r))),
        ("message", esc(r.message)),
    ]
    if r.resumed_from:
        cells.append(("resumed from", f"<a href='/jobs/{esc(r.resumed_from)}'>{esc(r.resumed_from)}</a>"))
    return table(("", ""), [(f"<b>{k}</b>", val) for k, val in cells])


def _failure(v: JobView) -> str:
    """The failure text: the job's message and every ERROR line of its log (tracebacks whole)."""
    if v.rec.state != JobState.FAILED:
        return ""
    errors = [
        f"[{'control plane' if e.rank < 0 else f'rank {e.rank}'}] {e.text}"
        for e in v.logs
        if e.level == "ERROR"
    ]
    return (
        f"<div class='failure'><h2>Failed: {esc(v.rec.reason)}</h2><pre id='failure-text'>"
        f"{esc(v.rec.message)}{chr(10) * 2 if errors else ''}{esc(chr(10).join(errors))}</pre></div>"
    )


def _curves(v: JobView) -> str:
    """The loss (and held-out loss) by step, the learning rate, the throughput and the step time: one
    point per step that counts, a dashed line where each attempt after the first began (``curves.py``)."""
    c = counted(v.events)
    by_step = [Marker(a.step, a.label) for a in c.attempts]
    started = v.rec.started if v.rec.started is not None else (c.steps[0].time if c.steps else 0.0)
    losses = [Series("loss", tuple((p.step, p.loss) for p in c.steps))]
    if c.evals:
        losses.append(Series("held-out loss", c.evals))
    lr = learning_rates(v.job, (p.step for p in c.steps))
    charts = [
        line_chart(losses, x_label="step", y_label="loss", title="training loss by step", markers=by_step),
        line_chart(
            [Series("learning rate", lr)],
            x_label="step",
            y_label="learning rate",
            title="learning rate by step",
            markers=by_step,
        )
        if lr
        else "",
        line_chart(
            [Series("samples/s", tuple((p.time - started, p.samples_per_second) for p in c.steps))],
            x_label="seconds since the job started",
            y_label="samples/s",
            title="throughput over time",
            markers=[Marker(a.time - started, a.label) for a in c.attempts],
        ),
        line_chart(
            [Series("step time (s)", tuple((p.step, p.step_seconds) for p in c.steps))],
            x_label="step",
            y_label="seconds",
            title="step time",
            markers=by_step,
        ),
    ]
    return "".join(charts)


def _workers(workers: Sequence[WorkerRecord]) -> str:
    rows = [
        (
            str(w.rank),
            esc(w.state.name),
            esc(w.host),
            esc(w.worker_id),
            str(w.step),
            esc(when(w.last_heartbeat)),
            f"{w.cpu_seconds:.1f}" if w.cpu_seconds else "",
            f"{w.rss_bytes / 2**20:,.0f} MiB" if w.rss_bytes else "",
        )
        for w in sorted(workers, key=lambda w: w.rank)
    ]
    head = ("rank", "state", "host", "worker", "step", "last heard", "CPU s", "memory (RSS)")
    return table(head, rows, "no workers yet")


def _checkpoints(found: Sequence[CheckpointInfo]) -> str:
    rows = [(str(c.step), esc(c.path), esc(f"{c.bytes:,} B")) for c in found]
    return table(
        ("step", "path", "size"), rows, "no checkpoints (the job has checkpoint_every=0, or none yet)"
    )


def _events(events: Sequence[JobEvent]) -> str:
    shown = [e for e in events if e.kind not in _CURVES][-EVENT_TAIL:]
    drawn = sum(e.kind in _CURVES for e in events)
    rows = [(esc(when(e.time)), esc(e.kind), esc(e.state.name), esc(e.reason), esc(e.message)) for e in shown]
    note = f"<p>and {drawn} step and evaluation events (the curves above)</p>" if drawn else ""
    return table(("time", "kind", "state", "reason", "message"), rows) + note


def _log(logs: Sequence[LogRecord]) -> str:
    if not logs:
        return "<p class='nodata'>no log lines yet</p>"
    tail = logs[-LOG_TAIL:]
    lines = "\n".join(
        f"{when(e.time)} {'cp' if e.rank < 0 else f'r{e.rank}'} {e.level}: {e.text}" for e in tail
    )
    more = (
        f"<p>the last {LOG_TAIL} of {len(logs)} lines; all: sbpflow logs ID</p>"
        if len(logs) > LOG_TAIL
        else ""
    )
    return f"<pre>{esc(lines)}</pre>{more}"


def _configuration(job: Job | None) -> str:
    if job is None:
        return "<p class='nodata'>the stored job does not decode with this version of sbpflow</p>"
    rows = [(esc(f.name), esc(getattr(job.config, f.name))) for f in dataclasses.fields(job.config)]
    if job.optimizer is not None:
        o = job.optimizer
        rows += [
            ("optimizer", esc(o.algorithm)),
            ("lr schedule", esc(o.schedule)),
            ("clip_grad_norm", esc(o.clip_grad_norm)),
        ]
    if job.data is not None:
        rows.append(("data", esc(job.data)))
    count = sum(job.graph.tensors[p.tensor].meta.numel for p in job.parameters)
    rows += [
        ("parameters", esc(f"{len(job.parameters)} tensors, {count:,} values")),
        ("ops", str(len(job.graph.ops))),
        ("loss", esc(job.loss)),
    ]
    return table(("setting", "value"), rows)
