"""Dynamic loss scaling through the job manager: each step's scale and skipped-step count in its step
event, the job's in its status (and the store, across a reopen) and in /metrics, equal to the numpy
GradScaler's (sbpflow/oracle/scaling.py); a job without it has none of them."""

from __future__ import annotations

from pathlib import Path

import sbpflow as sf
from sbpflow.codec import wire
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.status.metrics import Metrics
from sbpflow.control_plane.status.records import job_events, job_status
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.job import Job, LossScaling
from sbpflow.oracle import reference
from sbpflow.oracle.scaling import Scaler
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.compiler.passes.test_recompute import with_config
from tests.examples.test_examples import load


def run(store: JobStore, job: Job) -> str:
    m = JobManager(store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2))
    m.start()
    rec = m.submit(wire.job_to_proto(job).SerializeToString())
    for _ in m.follow(rec.id):
        pass
    m.shutdown()
    return rec.id


def scaled(steps: int) -> tuple[Job, Scaler, list[float], list[int]]:
    """An fp16 MLP on DP 2 whose scale backs off and grows within ``steps``, the oracle's scaler after
    it, and per step the scale after it and the steps skipped so far."""
    job = with_config(
        load("mlp").make_job(ranks=2, steps=steps),
        precision="fp16",
        loss_scaling=LossScaling(2.0**20, growth_interval=3),
    )
    want = reference.train(job).scaler
    assert want is not None and 0 < want.skipped_steps < steps
    after = [*want.history[1:], float(want.scale)]
    return job, want, after, [sum(want.skipped[: k + 1]) for k in range(steps)]


def test_skipped_steps_and_the_scale_in_step_events_status_and_metrics(tmp_path: Path) -> None:
    job, want, after, skipped_so_far = scaled(8)
    with JobStore(tmp_path / "j.db") as store:
        job_id = run(store, job)
        rec = store.get(job_id)
        assert rec.state == JobState.SUCCEEDED
        steps = [e.step for e in job_events(rec, store.events(job_id)) if e.HasField("step")]
        assert [s.loss_scale for s in steps] == after
        assert [s.skipped_steps for s in steps] == skipped_so_far
        status = job_status(rec)
        assert status.loss_scale == float(want.scale) and status.skipped_steps == want.skipped_steps
        text = Metrics(store, lambda _: []).exposition().decode()
        assert (
            f'sbpflow_job_skipped_steps_total{{job_id="{job_id}",name="{rec.name}"}} {want.skipped_steps}.0'
            in text
        )
        assert f'sbpflow_job_loss_scale{{job_id="{job_id}",name="{rec.name}"}} {float(want.scale)}' in text
    with JobStore(tmp_path / "j.db") as again:  # kept across a reopen
        assert again.get(job_id).skipped_steps == want.skipped_steps


def test_a_job_without_dynamic_scaling_reports_none(tmp_path: Path) -> None:
    with JobStore(tmp_path / "j.db") as store:
        job_id = run(store, load("mlp").make_job(ranks=2, steps=2))
        rec = store.get(job_id)
        status = job_status(rec)
        assert not status.HasField("loss_scale") and status.skipped_steps == 0
        steps = [e.step for e in job_events(rec, store.events(job_id)) if e.HasField("step")]
        assert len(steps) == 2 and not any(s.HasField("loss_scale") for s in steps)
        text = Metrics(store, lambda _: []).exposition().decode()
        assert f'sbpflow_job_skipped_steps_total{{job_id="{job_id}"' not in text


def test_ray_workers_report_the_scale_with_their_steps(ray_local: str) -> None:
    """The same through Ray workers' StepReports (DP 2), and RunResult's totals from their stores."""
    job, want, after, skipped_so_far = scaled(6)
    steps: list[sp.StepMetrics] = []
    got = sf.run(job, backend="ray", ray_address=ray_local, timeout=300, on_step=steps.append)
    assert got.skipped_steps == want.skipped_steps and got.loss_scale == float(want.scale)
    assert [s.loss_scale for s in steps] == after
    assert [s.skipped_steps for s in steps] == skipped_so_far
