"""The job manager without gRPC: admission, capacity, FIFO order, cancel, restart re-queue, store migration."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from pathlib import Path
from types import ModuleType

import pytest

from sbpflow.codec import wire
from sbpflow.control_plane.service.jobs import WAITING, JobManager, ManagerConfig, job_ranks
from sbpflow.control_plane.service.validation import ValidationError
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import SCHEMA_VERSION
from sbpflow.limits import LIMITS
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from tests.examples.test_examples import load


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


def blob(mlp: ModuleType, **kw: object) -> bytes:
    return wire.job_to_proto(mlp.make_job(**kw)).SerializeToString()


def wait_end(m: JobManager, job_id: str) -> JobState:
    for _ in m.follow(job_id):
        pass
    return m.store.get(job_id).state


def test_job_ranks(mlp: ModuleType) -> None:
    assert job_ranks(mlp.make_job(ranks=3)) == {0, 1, 2}


def test_fifo_within_capacity(tmp_path: Path, mlp: ModuleType) -> None:
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=3))
        m.start()
        big = m.submit(blob(mlp, ranks=3, steps=3))
        small = m.submit(blob(mlp, ranks=1, steps=3))  # fits only after big: waits (no overtaking)
        assert store.get(small.id).reason == WAITING or store.get(small.id).state.terminal
        assert wait_end(m, small.id) == JobState.SUCCEEDED == store.get(big.id).state
        assert store.get(big.id).finished <= store.get(small.id).started  # type: ignore[operator]
        m.shutdown()


def test_larger_than_the_cluster_is_refused_and_not_stored(tmp_path: Path, mlp: ModuleType) -> None:
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2))
        m.start()
        with pytest.raises(ValidationError, match="at most 2 ranks"):
            m.submit(blob(mlp, ranks=4))
        assert store.count() == 0


def test_pending_jobs_are_requeued_after_a_restart(tmp_path: Path, mlp: ModuleType) -> None:
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(
            store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2)
        )  # never started: jobs stay queued
        rec = m.submit(blob(mlp, steps=2))
        assert store.get(rec.id).state == JobState.PENDING
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2))
        m.start()
        assert wait_end(m, rec.id) == JobState.SUCCEEDED


def test_a_requeued_job_is_compiled_under_the_servers_limits(tmp_path: Path, mlp: ModuleType) -> None:
    run = MANAGER_DEFAULTS.replace(backend="inprocess")
    with JobStore(tmp_path / "j.db") as store:
        rec = JobManager(store, ManagerConfig(run=run, slots=2)).submit(blob(mlp, steps=2))  # never started
    small = dataclasses.replace(LIMITS, rank_tasks=8)  # the next server's limits are lower
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(store, ManagerConfig(run=run, slots=2, limits=small))
        m.start()
        assert wait_end(m, rec.id) == JobState.FAILED
        end = store.get(rec.id)
        assert end.reason == "COMPILE_LIMIT" and "Limits.rank_tasks" in end.message, end.message
        m.shutdown()


def test_shutdown_cancels_running_jobs(tmp_path: Path, mlp: ModuleType) -> None:
    with JobStore(tmp_path / "j.db") as store:
        m = JobManager(store, ManagerConfig(run=MANAGER_DEFAULTS.replace(backend="inprocess"), slots=2))
        m.start()
        rec = m.submit(blob(mlp, steps=100_000))
        while store.get(rec.id).step < 1:
            time.sleep(0.01)
        m.shutdown()
        end = store.get(rec.id)
        assert end.state == JobState.CANCELLED and end.reason == "CONTROL_PLANE_SHUTDOWN"
        with pytest.raises(Exception, match="shutting down"):
            m.submit(blob(mlp, steps=2))


def test_a_version_1_store_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL "
        "DEFAULT '', message TEXT NOT NULL DEFAULT '', attempt INTEGER NOT NULL DEFAULT 1, step INTEGER NOT NULL "
        "DEFAULT 0, loss REAL, samples_per_second REAL, created REAL NOT NULL, updated REAL NOT NULL, started "
        "REAL, finished REAL, job_proto BLOB NOT NULL, last_seq INTEGER NOT NULL DEFAULT 0);"
        "INSERT INTO jobs (id, name, state, created, updated, job_proto) VALUES "
        "('old', 'j', 'JOB_STATE_SUCCEEDED', 1, 1, x'');"
        "PRAGMA user_version=1;"
    )
    con.commit()
    con.close()
    with JobStore(path) as store:
        rec = store.get("old")
        assert rec.state == JobState.SUCCEEDED and rec.client_id == "" and rec.slots == 0
        assert store.workers("old") == [] and store.result("old") is None
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
