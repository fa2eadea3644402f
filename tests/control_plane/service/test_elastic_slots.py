"""The job manager counts the slots of the layout a job runs on: a job re-planned from 4 ranks onto 2
(an elastic shrink) gives the other 2 to a job waiting for them, and takes them back when it grows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sbpflow.codec import wire
from sbpflow.control_plane.launch.run_context import LaunchContext
from sbpflow.control_plane.service.jobs import WAITING, JobManager, ManagerConfig
from sbpflow.control_plane.service.run_listeners import RunListeners
from sbpflow.control_plane.service.running import RunningJob
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from tests.control_plane.service.test_server import until
from tests.examples.test_examples import load


def test_a_job_shrunk_onto_fewer_ranks_frees_its_slots_for_a_waiting_job(tmp_path: Path) -> None:
    mlp = load("mlp")
    big, small = mlp.make_job(ranks=4, steps=2), mlp.make_job(ranks=2, steps=2)
    with JobStore(tmp_path / "jobs.db") as store:
        m = JobManager(store, ManagerConfig(MANAGER_DEFAULTS.replace(backend="inprocess"), slots=4))
        m.start()
        try:
            rec = store.create(wire.job_to_proto(big).SerializeToString(), big.name, slots=4)
            running = RunningJob(big, 4)  # the 4-rank job, run from outside the manager (as on Ray)
            with m.adopted(rec.id, running):
                listeners = RunListeners(m, rec.id, running)
                for st in (JobState.COMPILING, JobState.STARTING, JobState.RUNNING):
                    listeners.on_state(st)
                waiting = m.submit(wire.job_to_proto(small).SerializeToString())
                assert store.get(waiting.id).reason == WAITING and m.used_slots == 4
                # the scheduler's elastic re-plan: attempt 2 on 2 ranks, told through the run's context
                ctx = LaunchContext(
                    steps=2, attempt=2, on_attempt=listeners.on_attempt, on_resize=listeners.on_resize
                )
                ctx.new_attempt("ELASTIC_RESUME", "re-planned from 4 ranks to 2", slots=2)
                assert running.slots == 2
                until(lambda: store.get(waiting.id).state == JobState.SUCCEEDED, "the waiting job's run", 120)
                dataclasses.replace(ctx, attempt=3).new_attempt(
                    "ELASTIC_GROW", "its own ranks are back", slots=4
                )
                assert running.slots == 4 and m.used_slots == 4 and store.get(rec.id).attempt == 3
        finally:
            m.shutdown()
