"""What a job's run says, turned into store writes: ``sf.run``'s listeners for one job of the job manager.

``on_state`` moves the job along its lifecycle, ``on_step`` records each step (numbered from the start
of the job, not of the run, which may resume a checkpoint), ``on_attempt`` records a restart as the
job's next attempt (reason ``WORKER_LOST``, a "state" event back to STARTING), and ``on_report`` keeps the
live per-worker rows and the workers' log lines. Every write wakes the manager's streams.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.run_state import JobState, WorkerState
from sbpflow.v1 import service_pb2 as sp

if TYPE_CHECKING:
    from sbpflow.control_plane.jobs import JobManager, RunningJob

# What each kind of WorkerReport payload says about the worker's state (None: leaves it as it is).
_WORKER_STATE: dict[str, WorkerState | None] = {
    "heartbeat": None,
    "memory": None,
    "log": None,
    "step": WorkerState.RUNNING,
    "done": WorkerState.DONE,
    "error": WorkerState.FAILED,
}


class RunListeners:
    """``run``'s listeners for one job: each turns what the run says into store writes."""

    def __init__(self, manager: JobManager, job_id: str, running: RunningJob, first_step: int = 0) -> None:
        self.m, self.job_id, self.r = manager, job_id, running
        self.first_step = first_step  # the run's steps count from here (it resumes a checkpoint)
        self._state_since = time.monotonic()

    def on_state(self, new: JobState) -> None:
        if self.m.store.get(self.job_id).state == new:
            return
        now = time.monotonic()
        if new == JobState.STARTING and self.m.metrics is not None:
            self.m.metrics.compile_seconds.observe(now - self._state_since)
        self._state_since = now
        self.m.store.transition(self.job_id, new)
        if new == JobState.STARTING:
            self._log(f"compiled; starting {self.r.slots} worker(s) on backend {self.m.config.run.backend}")
        self.m._notify(self.job_id)

    def on_step(self, s: sp.StepMetrics) -> None:
        step = self.first_step + s.step  # the run numbers its steps from its start
        self.m.store.record_step(self.job_id, step, s.loss, s.samples_per_second, s.step_seconds)
        if self.m.metrics is not None:
            self.m.metrics.step_seconds.observe(s.step_seconds)
        self.m._notify(self.job_id)

    def on_attempt(self, attempt: int, first_step: int, reason: str, message: str) -> None:
        """A restart: the job goes back to STARTING as attempt ``attempt`` from step ``first_step``; the
        old attempt's worker rows go (the new attempt's workers report afresh)."""
        self.r.workers.clear()
        self.m.store.new_attempt(self.job_id, attempt, JobState.STARTING, reason, message, first_step)
        self.m.store.append_log(self.job_id, -1, "WARNING", f"attempt {attempt}: {reason}: {message}")
        self.m._notify(self.job_id)

    def on_report(self, rep: sp.WorkerReport) -> None:
        kind = rep.WhichOneof("payload") or "heartbeat"
        old = self.r.workers.get(rep.rank)
        when = rep.time.ToNanoseconds() / 1e9 if rep.HasField("time") else time.time()
        state = _WORKER_STATE.get(kind) or (old.state if old else WorkerState.STARTING)
        step = rep.step.step if kind == "step" else (old.step if old else 0)
        self.r.workers[rep.rank] = WorkerRecord(
            self.job_id, rep.rank, rep.worker_id or (old.worker_id if old else ""), state,
            rep.host or (old.host if old else ""), step, when,
        )  # fmt: skip
        if kind == "log":
            self.m.store.append_log(self.job_id, rep.rank, rep.log.level or "INFO", rep.log.text, when)
        elif kind == "error":
            e = rep.error
            where = f"op {e.op_name} ({e.op_type}): " if e.op_name else ""
            self.m.store.append_log(
                self.job_id, rep.rank, "ERROR", f"{where}{e.cause}\n{e.traceback}".rstrip()
            )
        if kind in ("log", "error", "done"):
            self.m._notify(self.job_id)

    def _log(self, text: str) -> None:
        self.m.store.append_log(self.job_id, -1, "INFO", text)
