"""A job that evaluates on a held-out split, through the job manager: the latest held-out loss in its
status (and over the wire), in the store across a reopen, in /metrics, and as a log line."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbpflow.codec import wire
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.status.metrics import Metrics
from sbpflow.control_plane.status.records import job_status
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from tests.control_plane.launch.test_evaluation import job


def test_the_latest_held_out_loss_is_in_the_status_the_store_and_the_metrics(tmp_path: Path) -> None:
    j = job(every=2, steps=4)
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(
            store,
            ManagerConfig(
                run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2, checkpoint_root=str(tmp_path)
            ),
        )
        m.start()
        rec = m.submit(wire.job_to_proto(j).SerializeToString())
        for _ in m.follow(rec.id):
            pass
        m.shutdown()
        done = store.get(rec.id)
        assert done.state == JobState.SUCCEEDED and done.eval_step == 4 and done.eval_loss is not None
        status = job_status(done)
        assert status.eval_step == 4 and status.eval_loss == pytest.approx(done.eval_loss)
        logs = [r.text for r in store.logs(rec.id)]
        assert any("step 2: held-out loss" in t for t in logs) and any(
            "step 4: held-out loss" in t for t in logs
        )
        text = Metrics(store, lambda _: []).exposition().decode()
        assert f'sbpflow_job_eval_loss{{job_id="{rec.id}"' in text
    with JobStore(tmp_path / "j.db") as again:  # kept across a reopen
        assert again.get(rec.id).eval_loss == done.eval_loss


def test_a_job_that_never_evaluated_has_no_held_out_loss(tmp_path: Path) -> None:
    from tests.examples.test_examples import load

    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2))
        m.start()
        rec = m.submit(wire.job_to_proto(load("mlp").make_job(steps=1)).SerializeToString())
        for _ in m.follow(rec.id):
            pass
        m.shutdown()
        status = job_status(store.get(rec.id))
        assert status.eval_step == 0 and not status.HasField("eval_loss")


def test_a_version_4_store_is_migrated_and_then_keeps_held_out_losses(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "v4.db"
    with JobStore(path) as s:
        job_id = s.create(b"x", "j").id
    con = sqlite3.connect(path)  # what version 4 wrote: no evaluation columns
    con.executescript(
        "DROP INDEX jobs_live_resume; ALTER TABLE jobs DROP COLUMN cancel_requested; "  # version 7's
        "ALTER TABLE jobs DROP COLUMN eval_step; ALTER TABLE jobs DROP COLUMN eval_loss; ALTER TABLE jobs DROP COLUMN options; PRAGMA user_version=4;"
    )
    con.commit()
    con.close()
    with JobStore(path) as s:
        assert (s.get(job_id).eval_step, s.get(job_id).eval_loss) == (0, None)
        s.record_eval(job_id, 4, 1.5)
        s.record_eval(job_id, 2, 9.0)  # an older evaluation never replaces a newer one
        assert (s.get(job_id).eval_step, s.get(job_id).eval_loss) == (4, 1.5)
