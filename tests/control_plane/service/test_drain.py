"""Graceful drain: a real ``sbpflow server`` process gets a real SIGTERM mid-job. It refuses new jobs with
UNAVAILABLE while it drains, lets the checkpointing job reach a checkpoint, exits within its grace
period, and the next server on the same SQLite store resumes that job from that checkpoint; the job
ends with the losses of an uninterrupted run. A job that cannot checkpoint is lost, and says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from sbpflow.checkpoint import read as ck_read
from sbpflow.client.client import Client, ClientError
from sbpflow.control_plane.service.drain import DRAINED, Draining, drain
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.service.test_resume import blob, job_of
from tests.control_plane.service.test_server import LONG, start, until
from tests.examples.test_examples import load

GRACE = 4.0
STEPS, EVERY = 1500, 100  # a few seconds of steps on a loaded machine; a checkpoint every 100


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


def _server(db: Path, root: Path) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "sbpflow.client.cli.main", "server", "--backend", "inprocess", "--slots", "4",
           "--port", "0", "--http-port", "-1", "--store", str(db), "--checkpoint-root", str(root),
           "--drain-grace", str(GRACE)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "SBPFLOW_TOKEN": ""})
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split("gRPC on ")[1].split()[0]


def test_sigterm_drains_and_the_next_server_resumes_the_job(tmp_path: Path, mlp: ModuleType) -> None:
    db, root = tmp_path / "jobs.db", tmp_path / "ckpt"
    proc, address = _server(db, root)
    try:
        with Client(address) as c:
            saved = c.submit(job_of(mlp, STEPS, every=EVERY))
            unsaved = c.submit(job_of(mlp, LONG, every=0))  # holds the drain open for the whole grace
            until(lambda: ck_read.latest(root / saved.job_id) is not None, "a first checkpoint", 60)
            until(lambda: c.get(unsaved.job_id).step >= 2, "the second job to step")
            before = ck_read.latest(root / saved.job_id)
            assert before is not None and before.step < STEPS, "the job ended before the drain; lengthen it"
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            assert proc.stdout is not None
            seen = [proc.stdout.readline()]
            while seen[-1] and "SIGTERM: draining" not in seen[-1]:
                seen.append(proc.stdout.readline())
            assert "SIGTERM: draining" in seen[-1], seen
            with pytest.raises(ClientError) as refused:
                c.submit(job_of(mlp, 3))
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert "draining" in refused.value.details and "another server" in refused.value.details
        rest = proc.communicate(timeout=GRACE + 30)[0]
        assert proc.returncode == 0 and time.monotonic() - t0 < GRACE + 20, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    drained = ck_read.latest(root / saved.job_id)
    assert drained is not None and drained.step > before.step  # a checkpoint written during the drain
    assert f"{saved.job_id} at step {drained.step}" in rest and unsaved.job_id in rest
    with JobStore(db) as store:
        rec = store.get(saved.job_id)
        assert rec.state == JobState.RUNNING and rec.reason == DRAINED  # left in flight for the next
        assert f"at step {drained.step}" in rec.message
        assert "progress is lost" in store.get(unsaved.job_id).message
    p = start(tmp_path, store=str(db), checkpoint_root=str(root))  # the next server, on the same store
    try:
        with Client(p.address) as c:
            st = c.get(unsaved.job_id)
            assert sp.JobState.Name(st.state) == "JOB_STATE_FAILED" and st.reason == "CONTROL_PLANE_RESTARTED"
            end = c.handle(saved.job_id).wait(120)
            assert sp.JobState.Name(end.state) == "JOB_STATE_SUCCEEDED" and end.attempt == 2, end
            result = c.handle(saved.job_id).result()  # both attempts' losses, not only the resumed run's
            assert list(result.losses) == [pt.loss for pt in p.store.losses(saved.job_id)]
            whole = c.submit(job_of(mlp, STEPS, every=EVERY))  # the same job, never interrupted
            assert sp.JobState.Name(whole.wait(120).state) == "JOB_STATE_SUCCEEDED"
        resumed = [e for e in p.store.events(saved.job_id) if e.reason == "RESUMED_AFTER_RESTART"]
        assert len(resumed) == 1 and resumed[0].data["step"] == drained.step
        losses = [pt.loss for pt in p.store.losses(saved.job_id)]
        assert len(losses) == STEPS
        assert losses == [pt.loss for pt in p.store.losses(whole.job_id)]  # drained, resumed elsewhere
    finally:
        p.stop()


def test_a_drain_refuses_admission_and_is_bounded_by_its_grace(tmp_path: Path, mlp: ModuleType) -> None:
    """In process: the manager refuses Submit and Resume with ``Draining``; a job that never reaches a
    checkpoint is stopped at the grace period, left in flight, and named as unsaved."""
    with JobStore(tmp_path / "jobs.db") as store:
        config = ManagerConfig(
            run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=4, checkpoint_root=str(tmp_path / "c")
        )
        m = JobManager(store, config)
        m.start()
        try:
            rec = m.submit(blob(job_of(mlp, LONG, every=10**6)))  # checkpoints, but never within the grace
            until(lambda: store.get(rec.id).step >= 2, "steps")
            with pytest.raises(ValueError, match="grace=-1"):
                drain(m, -1)
            t0 = time.monotonic()
            d = drain(m, 0.5)
            assert 0.5 <= time.monotonic() - t0 < 10 and d.unsaved == (rec.id,) and not d.saved
            assert store.get(rec.id).state == JobState.RUNNING and store.get(rec.id).reason == DRAINED
            with pytest.raises(Draining, match="draining .* another server"):
                m.submit(blob(job_of(mlp, 3)))
            with pytest.raises(Draining, match="resumed job"):
                m.resume(rec.id)
        finally:
            m.shutdown()
