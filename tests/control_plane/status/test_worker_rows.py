"""Get's worker rows: a job with CACHE_FROM rows or more shows rows at most ROWS_SECONDS old (built once,
merged serialized), rebuilt at once on a state change; a smaller job's rows are always fresh. The rows
come from a run the manager ``adopted`` (a run driven from outside it), and go with it."""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

import pytest

from sbpflow.codec import wire
from sbpflow.control_plane.service.jobs import JobManager, ManagerConfig
from sbpflow.control_plane.service.running import RunningJob
from sbpflow.control_plane.service.server import JobServicer
from sbpflow.control_plane.status import worker_rows
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState, WorkerState
from tests.examples.test_examples import load


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


@pytest.mark.parametrize("ranks", [worker_rows.CACHE_FROM, 4])
def test_large_jobs_rows_are_at_most_rows_seconds_old(tmp_path: Path, mlp: ModuleType, ranks: int) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        m = JobManager(store, ManagerConfig(MANAGER_DEFAULTS.replace(backend="inprocess"), slots=ranks))
        job = mlp.make_job(ranks=ranks, batch_size=2 * ranks)
        rec = store.create(wire.job_to_proto(job).SerializeToString(), job.name, slots=ranks)
        r = RunningJob(job, ranks)
        servicer = JobServicer(m)

        def at(step: int) -> None:
            for k in range(ranks):
                r.workers[k] = WorkerRecord(rec.id, k, f"w{k}", WorkerState.RUNNING, "h", step, time.time())

        def steps() -> set[int]:
            return {w.step for w in servicer.status_of(rec.id).workers}

        with m.adopted(rec.id, r):
            at(1)
            assert steps() == {1} and len(servicer.status_of(rec.id).workers) == ranks
            at(2)
            cached = ranks >= worker_rows.CACHE_FROM
            assert steps() == ({1} if cached else {2})  # within ROWS_SECONDS: the rows built at step 1
            time.sleep(worker_rows.ROWS_SECONDS)
            assert steps() == {2}
            at(3)
            store.transition(rec.id, JobState.COMPILING)  # a state change: rebuilt at once
            assert steps() == {3}
        time.sleep(worker_rows.ROWS_SECONDS)
        assert servicer.status_of(rec.id).workers == []  # the run has gone: the store's rows (none)
