"""A job's curves as the store's events say them: a job restarted from a checkpoint draws one point per
step that counts (the later attempt's from its resume point on) and a marker where each attempt began;
the held-out losses and the learning rate are series of their own."""

from __future__ import annotations

import dataclasses
import math
import re
import xml.etree.ElementTree as ET

from sbpflow.codec import wire
from sbpflow.control_plane.status import web_job
from sbpflow.control_plane.status.curves import counted, learning_rates
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.job import Job, WarmupCosine
from sbpflow.runs.states import JobState
from tests.examples.test_examples import load

STEPS, LOST_AT, RESUMED_AT = (
    400,
    212,
    200,
)  # attempt 1 reached step 212; attempt 2 resumed step 200's checkpoint
BASE_LR = 0.01


def _job() -> Job:
    job = load("mlp").make_job(steps=STEPS)
    assert job.optimizer is not None
    algorithm = dataclasses.replace(job.optimizer.algorithm, lr=BASE_LR)
    schedule = WarmupCosine(warmup_steps=10, total_steps=STEPS, min_lr_ratio=0.1)
    return dataclasses.replace(
        job, optimizer=dataclasses.replace(job.optimizer, algorithm=algorithm, schedule=schedule)
    )


def _restarted(store: JobStore, job: Job) -> str:
    """A job whose first attempt ran to ``LOST_AT`` and whose second resumed ``RESUMED_AT`` to the end;
    the losses say which attempt ran a step (1.0 + step/1000 the first, 2.0 + ... the second)."""
    rec = store.create(wire.job_to_proto(job).SerializeToString(), job.name, total_steps=STEPS)
    for st in (JobState.COMPILING, JobState.STARTING, JobState.RUNNING):
        store.transition(rec.id, st)
    for s in range(1, LOST_AT + 1):
        store.record_step(rec.id, s, 1.0 + s / 1000, 100.0, 0.01)
        if s % 100 == 0 or s == 210:
            store.record_eval(rec.id, s, 0.5 + s / 1000)
    store.new_attempt(rec.id, 2, JobState.STARTING, "WORKER_LOST", "rank 1 lost", RESUMED_AT)
    store.transition(rec.id, JobState.RUNNING)
    for s in range(RESUMED_AT + 1, STEPS + 1):
        store.record_step(rec.id, s, 2.0 + s / 1000, 100.0, 0.02)
        if s % 100 == 0:
            store.record_eval(rec.id, s, 0.7 + s / 1000)
    store.transition(rec.id, JobState.SUCCEEDED)
    return rec.id


def _charts(page: str) -> dict[str, ET.Element]:
    """Each chart of a page by its title, parsed as XML (the SVG is well-formed, every value escaped)."""
    out = {}
    for svg in re.findall(r"<svg class='chart'.*?</svg>", page, re.S):
        root = ET.fromstring(svg)
        out[root.findtext("title") or ""] = root
    return out


def _series(chart: ET.Element) -> dict[str, list[tuple[float, float]]]:
    out = {}
    for g in chart.iter("g"):
        if g.get("class") == "series":
            line = g.find("polyline")
            assert line is not None
            out[g.get("data-name") or ""] = [
                (float(x), float(y)) for x, y in (p.split(",") for p in (line.get("points") or "").split())
            ]
    return out


def test_a_restarted_job_draws_each_counted_step_once_and_marks_the_attempt() -> None:
    store, job = JobStore(":memory:"), _job()
    job_id = _restarted(store, job)
    events = store.events(job_id)
    assert sum(e.kind == "step" for e in events) == STEPS + (LOST_AT - RESUMED_AT)  # 412 step events
    c = counted(events)
    assert [p.step for p in c.steps] == list(range(1, STEPS + 1))
    assert all(p.loss == (1.0 if p.step <= RESUMED_AT else 2.0) + p.step / 1000 for p in c.steps)
    assert [(a.attempt, a.step, a.label) for a in c.attempts] == [(2, 200, "attempt 2 from step 200")]
    assert c.evals == ((100, 0.6), (200, 0.7), (300, 1.0), (400, 1.1))  # attempt 1's at 210 was redone

    view = web_job.JobView(
        rec=store.get(job_id), job=job, workers=[], events=events, logs=[], checkpoints=[],
        plan_summary="", plan_picture="",
    )  # fmt: skip
    charts = _charts(web_job.page(view, signed_in=False))
    loss = charts["training loss by step"]
    lines = _series(loss)
    assert len(lines["loss"]) == STEPS and len(lines["held-out loss"]) == 4
    xs = [x for x, _ in lines["loss"]]
    assert xs == sorted(xs) and len(set(xs)) == STEPS  # one point a step, left to right
    for title in ("training loss by step", "learning rate by step", "step time", "throughput over time"):
        marks = [g for g in charts[title].iter("g") if g.get("class") == "marker"]
        assert [m.get("data-label") for m in marks] == ["attempt 2 from step 200"], title
    legend = [t.text for g in loss.iter("g") if g.get("class") == "legend" for t in g.iter("text")]
    assert legend == ["loss", "held-out loss"]


def test_the_learning_rate_is_the_schedules_at_each_step() -> None:
    job = _job()
    got = dict(learning_rates(job, range(1, STEPS + 1)))
    # linear warm-up over 10 steps (step s applies optimizer step s - 1), then cosine down to 0.1 * lr
    assert math.isclose(got[1], BASE_LR / 10) and math.isclose(got[10], BASE_LR)
    t = (STEPS - 1 - 10) / (STEPS - 10)
    assert math.isclose(got[STEPS], BASE_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))))
    assert learning_rates(dataclasses.replace(job, optimizer=None), range(1, 5)) == ()
    store = JobStore(":memory:")
    job_id = _restarted(store, job)
    view = web_job.JobView(
        rec=store.get(job_id), job=job, workers=[], events=store.events(job_id), logs=[], checkpoints=[],
        plan_summary="", plan_picture="",
    )  # fmt: skip
    (lr,) = _series(_charts(web_job.page(view, signed_in=False))["learning rate by step"]).values()
    ys = [y for _, y in lr]
    assert len(lr) == STEPS and min(ys) == ys[9] and ys[0] > ys[9]  # y grows downwards: the peak at step 10
