"""What a job's run says, turned into store writes: ``sf.run``'s listeners for one job of the job manager.

``on_state`` moves the job along its lifecycle, ``on_step`` records each step (numbered from the start
of the job, not of the run, which may resume a checkpoint), ``on_eval`` the held-out loss, ``on_attempt`` records a restart as the
job's next attempt (reason ``WORKER_LOST``, a "state" event back to STARTING), and ``on_report`` keeps the
live per-worker rows (with each process's CPU seconds and resident memory from its latest step report or
heartbeat) and the workers' log lines. Every write wakes the manager's streams.

A store that cannot write for a while (a full disk, a lost volume) must neither lose what the run said
nor reach into the run: every write goes through an ordered queue, a write that fails with
``StoreUnavailable`` stays queued (with every later one behind it) and is retried at the next write and
by :meth:`RunListeners.close` when the run ends; the job's end (:meth:`RunListeners.finish`) queues
behind them. A queue of ``MAX_UNWRITTEN`` writes cancels the run (the store has been gone too long to
keep its rows in memory).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sbpflow.control_plane.launch.run_context import RunRequest
from sbpflow.control_plane.service.running import Manager, RunningJob
from sbpflow.control_plane.store.db import StoreUnavailable
from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.runs.states import JobState, WorkerState
from sbpflow.v1 import service_pb2 as sp

# What each kind of WorkerReport payload says about the worker's state (None: leaves it as it is).
_WORKER_STATE: dict[str, WorkerState | None] = {
    "heartbeat": None,
    "memory": None,
    "log": None,
    "step": WorkerState.RUNNING,
    "done": WorkerState.DONE,
    "error": WorkerState.FAILED,
}
# The payloads that carry the worker process's usage (cpu_seconds, rss_bytes), by kind.
_USAGE: dict[str, Callable[[sp.WorkerReport], sp.StepReport | sp.Heartbeat]] = {
    "step": lambda rep: rep.step,
    "heartbeat": lambda rep: rep.heartbeat,
}

log = logging.getLogger(__name__)
MAX_UNWRITTEN = 100_000  # store writes held while the store cannot write (a few MB) before the run stops
RETRY_SECONDS = 0.5  # between two tries of a flush at the run's end


class RunListeners:
    """``run``'s listeners for one job: each turns what the run says into store writes."""

    def __init__(self, manager: Manager, job_id: str, running: RunningJob, first_step: int = 0) -> None:
        self.m, self.job_id, self.r = manager, job_id, running
        self.first_step = first_step  # the run's steps count from here (it resumes a checkpoint)
        self._state_since = time.monotonic()
        self._state: JobState | None = None  # the last state asked for (the store may lag while queued)
        self._unwritten: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._lock = threading.Lock()  # listeners are called from the run's and the report threads

    def heard_by(self, request: RunRequest) -> RunRequest:
        """``request`` with these listeners as its own."""
        return dataclasses.replace(
            request,
            on_state=self.on_state,
            on_step=self.on_step,
            on_report=self.on_report,
            on_attempt=self.on_attempt,
            on_resize=self.on_resize,
            on_eval=self.on_eval,
        )

    def on_state(self, new: JobState) -> None:
        if (self._state or self.m.store.get(self.job_id).state) == new:
            return
        self._state = new
        now = time.monotonic()
        if new == JobState.STARTING and self.m.metrics is not None:
            self.m.metrics.compile_seconds.observe(now - self._state_since)
        self._state_since = now
        self.write(self.m.store.transition, self.job_id, new)
        if new == JobState.STARTING:
            self._log(f"compiled; starting {self.r.slots} worker(s) on backend {self.m.backend}")
        self.m.notify(self.job_id)

    def on_step(self, s: sp.StepMetrics) -> None:
        step = self.first_step + s.step  # the run numbers its steps from its start
        scaling = (s.loss_scale, int(s.skipped_steps)) if s.HasField("loss_scale") else None
        self.write(
            self.m.store.record_step, self.job_id, step, s.loss, s.samples_per_second, s.step_seconds, scaling
        )
        if self.m.metrics is not None:
            self.m.metrics.step_seconds.observe(s.step_seconds)
        self.m.notify(self.job_id)

    def on_eval(self, step: int, loss: float) -> None:
        """An evaluation on the held-out split at ``step`` (numbered from the job's start already)."""
        self.write(self.m.store.record_eval, self.job_id, step, loss)
        self.write(self.m.store.append_log, self.job_id, -1, "INFO", f"step {step}: held-out loss {loss:.4f}")
        self.m.notify(self.job_id)

    def on_attempt(self, attempt: int, first_step: int, reason: str, message: str) -> None:
        """A restart: the job goes back to STARTING as attempt ``attempt`` from step ``first_step``; the
        old attempt's worker rows go (the new attempt's workers report afresh)."""
        self.r.workers.clear()
        self._state = JobState.STARTING
        self.write(
            self.m.store.new_attempt, self.job_id, attempt, JobState.STARTING, reason, message, first_step
        )
        self.write(
            self.m.store.append_log, self.job_id, -1, "WARNING", f"attempt {attempt}: {reason}: {message}"
        )
        self.m.notify(self.job_id)

    def on_resize(self, slots: int) -> None:
        """The run holds ``slots`` device slots from its next attempt on: an elastic re-plan onto fewer ranks
        gives the rest to queued jobs (``elastic.py``); growing back takes them again."""
        self.m.resize(self.r, slots)

    def write(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the store, in order behind every write still queued; never raises
        ``StoreUnavailable`` into the run (see the module's docstring)."""
        with self._lock:
            self._unwritten.append((fn, args))
            self._drain()
            if len(self._unwritten) >= MAX_UNWRITTEN and not self.r.cancel.is_set():
                self.r.cancel_message = (
                    f"the job store could not write for {len(self._unwritten)} writes in a row "
                    f"({self.m.store.write_error}); free its disk or fix its volume, then resume the job"
                )
                self.r.cancel.set()

    def _drain(self) -> bool:
        """Write what is queued, oldest first, until a write fails; True when nothing is left. Under the
        lock."""
        while self._unwritten:
            fn, args = self._unwritten[0]
            try:
                fn(*args)
            except StoreUnavailable as e:
                if len(self._unwritten) == 1:  # the first write of an outage
                    log.warning("job %s: %s; its writes are held and retried", self.job_id, e)
                return False
            self._unwritten.popleft()
        return True

    def flush(self, timeout: float) -> bool:
        """Write everything still queued, retrying for up to ``timeout`` s (the run has ended); True when
        it all went."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._drain():
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(RETRY_SECONDS)

    def finish(self, state: JobState, reason: str, message: str) -> None:
        """The job's end, behind every write still queued: its closing log line, then its terminal state
        (last: a stream that sees it has every line)."""
        if state == JobState.CANCELLED:  # its workers were stopped, not broken: they read as cancelled
            for rank, w in list(self.r.workers.items()):
                if w.state != WorkerState.DONE:
                    self.r.workers[rank] = dataclasses.replace(w, state=WorkerState.CANCELLED)
        level = "INFO" if state == JobState.SUCCEEDED else "ERROR"
        text = f"{state.name} {reason}: {message}".replace(" :", ":")
        self.write(self.m.store.append_log, self.job_id, -1, level, text)
        self.write(self.m.store.transition, self.job_id, state, reason, message)
        if self.m.metrics is not None:
            self.m.metrics.finished(state)

    def close(self, workers: list[WorkerRecord], timeout: float) -> None:
        """The run's last writes (its worker rows), then everything held is retried for ``timeout`` s; a
        store still gone then keeps the job non-terminal, and a restarted control plane re-queues it."""
        for w in workers:
            self.write(self.m.store.upsert_worker, w)
        if not self.flush(timeout):
            log.error(
                "job %s: %d store writes could not be made in %.0f s (%s); the job stays %s in the store "
                "until a restarted control plane takes it up again",
                self.job_id, len(self._unwritten), timeout, self.m.store.write_error, self._state,
            )  # fmt: skip

    def on_report(self, rep: sp.WorkerReport) -> None:
        kind = rep.WhichOneof("payload") or "heartbeat"
        old = self.r.workers.get(rep.rank)
        when = rep.time.ToNanoseconds() / 1e9 if rep.HasField("time") else time.time()
        state = _WORKER_STATE.get(kind) or (old.state if old else WorkerState.STARTING)
        step = rep.step.step if kind == "step" else (old.step if old else 0)
        cpu, rss = (old.cpu_seconds, old.rss_bytes) if old else (0.0, 0)
        if kind in _USAGE:  # a payload that says the process's CPU and memory
            said = _USAGE[kind](rep)
            cpu, rss = said.cpu_seconds or cpu, said.rss_bytes or rss  # 0: not measured (an older worker)
        self.r.workers[rep.rank] = WorkerRecord(
            self.job_id, rep.rank, rep.worker_id or (old.worker_id if old else ""), state,
            rep.host or (old.host if old else ""), step, when, cpu, rss,
        )  # fmt: skip
        if kind == "log":
            self.write(
                self.m.store.append_log, self.job_id, rep.rank, rep.log.level or "INFO", rep.log.text, when
            )
        elif kind == "error":
            e = rep.error
            where = f"op {e.op_name} ({e.op_type}): " if e.op_name else ""
            text = f"{where}{e.cause}\n{e.traceback}".rstrip()
            self.write(self.m.store.append_log, self.job_id, rep.rank, "ERROR", text)
        if kind in ("log", "error", "done"):
            self.m.notify(self.job_id)

    def _log(self, text: str) -> None:
        self.write(self.m.store.append_log, self.job_id, -1, "INFO", text)
