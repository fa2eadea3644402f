"""The job manager: admits jobs, queues them, runs each on its own thread within the cluster's capacity.

    manager = JobManager(JobStore("jobs.db"), ManagerConfig(MANAGER_DEFAULTS.replace(backend="inprocess"), slots=4))
    manager.start()                       # reconcile the store after a restart, re-queue PENDING jobs
    rec = manager.submit(job_bytes)       # validated (ValidationError) and stored PENDING, or refused
    manager.cancel(rec.id, "not needed")  # PENDING: CANCELLED at once; in flight: the run is stopped
    new = manager.resume(rec.id)          # a new job going on from rec's latest checkpoint (resume.py)

Rules:
- Submit validates first and stores after, so a refused job leaves nothing behind.
- A job needs one slot per device rank it is placed on; the capacity is ``ManagerConfig.slots``, or the
  Ray cluster's CPUs (backend ray), or this machine's CPUs. A job larger than the whole capacity is
  refused at Submit; the others wait PENDING with reason ``WAITING_FOR_RESOURCES`` and start in
  submission order (first come, first served: a large job is not overtaken forever by small ones).
- A job is compiled once: Submit's compile (graph passes) stays in memory with the queued job, and the
  run only lowers it (``launcher.launch``); a job re-queued after a restart is compiled again.
- Each running job has one thread (``job_run.py``) that calls ``sbpflow.control_plane.launch.launcher.launch``
  and turns its listeners (``run_listeners.py``) into store writes: states, steps (loss history),
  per-worker rows and log lines. Every store write is a notice to ``feed`` (``job_feed.py``): a job's
  ``Watch`` streams wake on its own changes and share one store read a change; ``Logs`` streams wait on
  every change.
- Checkpoints (``checkpoint_root``): job ID writes them to ``<root>/ID``. A lost worker restarts the run
  from the latest one (up to ``max_restarts``): the job's attempt grows, with a "state" event (reason
  ``WORKER_LOST``) naming the rank; a job with fallback rank counts whose ranks are not back within its
  grace period goes on with fewer (reason ``ELASTIC_RESUME``, ``elastic.py``; each fallback is checked
  at Submit). After a control-plane restart, a job that was in flight and has a checkpoint is queued
  again as its next attempt (``RESUMED_AFTER_RESTART``) and goes on from it; one without stays FAILED
  (``CONTROL_PLANE_RESTARTED``). A drain (SIGTERM, ``drain.py``) refuses admission (``Draining``) and
  leaves the jobs it stops in flight, for the next control plane to re-queue.
- A run driven from outside (``bench/control_plane/control_plane_scale.py``'s simulated workers) is
  ``adopted``.
- A run whose loss goes NaN or infinite ends FAILED with ``NON_FINITE_LOSS`` at that step; one whose final
  parameters are not finite ends FAILED with ``NON_FINITE_PARAMETERS`` (:mod:`sbpflow.runs.numerics`).
- A corrupt latest checkpoint is passed over for the previous intact one (a log line and a reason
  event ``CHECKPOINT_CORRUPT`` say so).
- Cancel is stored (``JobStore.request_cancel``) before it is acknowledged: a run that then ends in any
  way ends CANCELLED, and a control plane restarted first (a SIGTERM drain racing the Cancel) ends the job
  CANCELLED rather than resume it. Resume is idempotent like Submit (the same key returns the same new
  job), and one job not yet ended at most resumes a given job: the store refuses a second
  (``AlreadyResuming`` -> ``NotResumable``, FAILED_PRECONDITION, naming the first).
- A checkpoint root that is full or read-only (a run's failed write, or a probe at start and at most every
  few seconds, ``job_checkpoints.StorageProbe``) makes ``unready_reason`` say so: ``/readyz`` 503.
- Reasons are machine-readable words (service.proto's JobStatus.reason); messages say what happened.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sbpflow.checkpoint.read import CheckpointInfo, CorruptCheckpoint, corrupt_note, list_checkpoints
from sbpflow.control_plane.service import resume as resuming
from sbpflow.control_plane.service.drain import Draining
from sbpflow.control_plane.service.job_checkpoints import StorageProbe, resumable
from sbpflow.control_plane.service.job_feed import JobFeed
from sbpflow.control_plane.service.job_options import job_options
from sbpflow.control_plane.service.job_run import CANCELLED_BY_USER, run_job
from sbpflow.control_plane.service.running import RunningJob
from sbpflow.control_plane.service.validation import (
    ValidationError,
    check_fallbacks,
    compile_submit,
    describe_cluster,
)
from sbpflow.control_plane.store.job_store import AlreadyResuming, JobStore
from sbpflow.control_plane.store.schema import JobRecord, WorkerRecord
from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.limits import LIMITS, Limits
from sbpflow.runs.options import MANAGER_DEFAULTS, RunOptions
from sbpflow.runs.states import JobState
from sbpflow.v1 import service_pb2 as sp

if TYPE_CHECKING:
    from sbpflow.control_plane.compiler.pipeline import Compiled
    from sbpflow.control_plane.launch.run_context import RunResult
    from sbpflow.control_plane.service.data_policy import DataPolicy
    from sbpflow.control_plane.status.metrics import Metrics

WAITING = "WAITING_FOR_RESOURCES"
WORKER_LOST = "WORKER_LOST"

_TERMINAL_CODES = frozenset({sp.JOB_STATE_SUCCEEDED, sp.JOB_STATE_FAILED, sp.JOB_STATE_CANCELLED})


@dataclass(frozen=True)
class ManagerConfig:
    run: RunOptions = MANAGER_DEFAULTS  # how every job runs: backend, Ray address, timeout, restarts, ...
    slots: int | None = None  # capacity in device slots; None: the Ray cluster's CPUs / this machine's
    max_job_bytes: int | None = None  # refuse larger Job protobufs at Submit
    keep_run_results: bool = False  # keep each RunResult in memory (the embedded `sbpflow run`)
    checkpoint_root: str | None = None  # job ID's checkpoints go to <root>/<ID> (checkpoint_every > 0)
    data_policy: DataPolicy | None = None  # which files jobs' data may name (data_policy.py); None: any
    device_memory: int | None = None  # bytes per device at Submit; None: Ray's or the machine's; 0: off
    limits: Limits = LIMITS  # a job's values and its compile's size, checked at Submit (sbpflow.limits)
    tensorboard_dir: str | None = None  # job ID's TensorBoard scalars go to <dir>/<ID>


def job_ranks(job: Job) -> set[int]:
    """The device ranks a job is placed on: one slot each."""
    g = job.graph
    pls = [t.placement for t in g.tensors.values()] + [o.placement for o in g.ops]
    return {r for pl in pls if pl is not None for r in pl.ranks}


def cluster_capacity(config: ManagerConfig) -> int:
    """Device slots the manager may fill: ``config.slots``, else Ray's CPUs (backend ray), else os CPUs."""
    if config.slots is not None:
        if config.slots < 1:
            raise SbpflowError(f"slots={config.slots}: give at least 1 (one slot per device rank of a job)")
        return config.slots
    if config.run.backend == "ray":
        from sbpflow.control_plane.launch.ray_backend import ensure_ray

        # before anything imports ray: a local one then advertises 127.0.0.1
        ensure_ray(config.run.ray_address, 1)
        import ray

        return max(1, int(ray.cluster_resources().get("CPU", 0)))
    return os.cpu_count() or 1


STORE_FLUSH_SECONDS = 60.0  # at a run's end, how long its held store writes are retried


class JobManager:
    """Admission, queue, runner threads and cancellation over one ``JobStore``."""

    def __init__(
        self,
        store: JobStore,
        config: ManagerConfig,
        metrics: Metrics | None = None,
        report_hub: Any = None,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.report_hub = report_hub
        self.capacity = cluster_capacity(config)
        self.cluster = describe_cluster(config.run.backend, self.capacity, config.device_memory)
        self.feed = JobFeed(store)  # what Watch and Logs streams wait on
        self._lock = threading.RLock()
        self._queue: list[str] = []  # PENDING job ids, oldest first
        self._running: dict[str, RunningJob] = {}
        self._jobs: dict[str, Job] = {}  # parsed jobs of the queue, so they are not parsed twice
        self._compiled: dict[str, Compiled] = {}  # their Submit compiles, so they are not compiled twice
        self.run_results: dict[str, RunResult] = {}
        self.storage = StorageProbe(config.checkpoint_root)  # does the checkpoint root take writes?
        self.ready = False
        self._closed = False
        self.draining = False

    # ---- lifecycle of the manager -----------------------------------------------------------------

    def start(self) -> list[JobRecord]:
        """Reconcile the store after a restart (jobs in flight -> PENDING as their next attempt when they
        have a checkpoint to go on from, else FAILED) and re-queue PENDING jobs; returns the reconciled
        records."""
        from sbpflow.codec import wire
        from sbpflow.v1 import job_pb2

        if self.config.run.backend == "ray":  # on the caller's (main) thread: Ray sets signal handlers there
            from sbpflow.control_plane.launch.ray_backend import ensure_ray

            ensure_ray(self.config.run.ray_address, self.capacity)
        reconciled = self.store.reconcile_after_restart(
            lambda rec: resumable(self.config.checkpoint_root, rec)
        )
        pending = sorted(self.store.list([JobState.PENDING], limit=1 << 30), key=lambda r: r.created)
        with self._lock:
            for rec in pending:
                self._jobs[rec.id] = wire.job_from_proto(job_pb2.Job.FromString(rec.job_proto))
                self._queue.append(rec.id)
            self.ready = True
        self.storage.problem()  # probe the checkpoint root now, so that /readyz knows from the start
        self._schedule()
        self.notify()
        return reconciled

    def begin_drain(self) -> dict[str, RunningJob]:
        """Admit and start nothing more (:mod:`.drain` does the rest); returns the running jobs."""
        with self._lock:
            self.ready, self.draining = False, True
            return dict(self._running)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, cancel every running job and wait for their threads (at most ``timeout`` s)."""
        with self._lock:
            self.ready, self._closed = False, True
            running = list(self._running.items())
        for _, r in running:
            r.cancel_message = "the control plane is shutting down"
            r.cancel.set()
        deadline = time.monotonic() + timeout
        for _, r in running:
            if r.thread is not None:
                r.thread.join(max(0.0, deadline - time.monotonic()))

    # ---- the API ----------------------------------------------------------------------------------

    def submit(
        self, job_bytes: bytes, client_id: str = "", idempotency_key: str = "", options: bytes = b""
    ) -> JobRecord:
        """Validate and store a job (PENDING), then schedule; raises ``ValidationError`` for bad input.
        ``options``: the serialized RunOptions its client set (``job_options.py``; OptionRefused)."""
        return self._admit(job_bytes, client_id, idempotency_key, options=options)

    def resume(
        self, job_id: str, job_bytes: bytes | None = None, client_id: str = "", idempotency_key: str = ""
    ) -> JobRecord:
        """A new job (PENDING, ``resumed_from`` = ``job_id``) going on from the ended job's latest checkpoint:
        ``job_bytes`` (another layout, say) or the job as submitted; ``NotResumable`` or ``ValidationError``
        when it cannot (:mod:`.resume`)."""
        from sbpflow.checkpoint.read import CheckpointReader

        if self.draining:
            raise Draining("resumed job")
        earlier = self.store.find(client_id, idempotency_key) if idempotency_key else None
        if earlier is not None:  # a retried Resume: the job the first one made, whatever happened since
            return earlier
        rec = self.store.get(job_id)
        passed: list[CorruptCheckpoint] = []
        found = resuming.checkpoint_to_resume(self.config.checkpoint_root, rec, passed.append)
        reader = CheckpointReader(found.path)
        try:
            new = self._admit(
                rec.job_proto if job_bytes is None else job_bytes,
                client_id,
                idempotency_key,
                check=lambda job: resuming.check_compatible(job, reader),
                resumed_from=rec.id,
                resume_checkpoint=str(found.path),
                options=rec.options,  # the resumed job's client options go on with it
            )
        except AlreadyResuming as e:  # a concurrent Resume stored its job first (the store decides)
            raise resuming.NotResumable(str(e)) from None
        for c in passed:
            self.store.append_log(new.id, -1, "WARNING", corrupt_note(c, found.step))
        return new

    def _admit(
        self,
        job_bytes: bytes,
        client_id: str,
        idempotency_key: str,
        check: Callable[[Job], None] = lambda job: None,
        resumed_from: str = "",
        resume_checkpoint: str = "",
        options: bytes = b"",
    ) -> JobRecord:
        job_options(sp.RunOptions.FromString(options), self.config.run)  # before any work: OptionRefused
        if self.draining:
            raise Draining()
        if self._closed:
            raise SbpflowError("the control plane is shutting down; submit to another or retry later")
        compiled = compile_submit(
            job_bytes, self.cluster, self.config.max_job_bytes, self.config.data_policy, self.config.limits
        )
        job = compiled.state.job
        slots = len(job_ranks(job))
        if slots > self.capacity:
            raise ValidationError(
                f"job {job.name!r} is placed on {slots} ranks, but the cluster has {self.capacity} slot(s); "
                f"place it on at most {self.capacity} ranks or add workers to the cluster",
                kind="compile",
                field="job.graph",
            )
        check(job)
        check_fallbacks(job)  # JobConfig.elastic: each fallback re-places (elastic.py)
        with self._lock:
            rec = self.store.create(
                job_bytes,
                job.name,
                client_id=client_id,
                idempotency_key=idempotency_key,
                total_steps=job.config.steps,
                slots=slots,
                resumed_from=resumed_from,
                resume_checkpoint=resume_checkpoint,
                options=options,
            )
            fresh = (
                rec.state == JobState.PENDING and rec.id not in self._queue and rec.id not in self._running
            )
            if fresh:
                self._jobs[rec.id] = job
                self._compiled[rec.id] = compiled
                self._queue.append(rec.id)
        if fresh and resumed_from:  # not again for a retried (deduplicated) Resume
            self.store.append_log(rec.id, -1, "INFO", f"resumes job {resumed_from} from {resume_checkpoint}")
        self._schedule()
        self.notify(rec.id)
        return self.store.get(rec.id)

    def cancel(self, job_id: str, reason: str = "") -> JobRecord:
        """Cancel a job: a queued one at once, a running one by stopping its run. A finished job is
        returned as it is. The request is stored first: a control plane restarted before the run stops
        ends the job CANCELLED instead of resuming it."""
        message = reason or "cancelled by the user"
        self.store.request_cancel(job_id, message)
        with self._lock:
            rec = self.store.get(job_id)
            if rec.id in self._queue:
                self._queue.remove(rec.id)
                self._jobs.pop(rec.id, None)
                self._compiled.pop(rec.id, None)
                rec = self.store.transition(job_id, JobState.CANCELLED, CANCELLED_BY_USER, message)
            elif rec.id in self._running:
                self._running[rec.id].cancel_message = message
                self._running[rec.id].cancel.set()
        self._schedule()
        self.notify(job_id)
        return self.store.get(job_id)

    @contextmanager
    def adopted(self, job_id: str, r: RunningJob) -> Iterator[RunningJob]:
        """``r`` is ``job_id``'s run while the block runs (a run driven from outside the manager); its live
        worker rows serve Get, List and /metrics as a run's of the manager's own do."""
        with self._lock:
            self._running[job_id] = r
        try:
            yield r
        finally:
            with self._lock:
                self._running.pop(job_id, None)

    def workers(self, job_id: str) -> list[WorkerRecord]:
        """Per-worker rows: live ones for a running job, else the stored ones."""
        with self._lock:
            r = self._running.get(job_id)
            if r is not None:
                live = dict(r.workers)  # a restart clears it from the run's thread
                return [live[k] for k in sorted(live)]
        return self.store.workers(job_id)

    def checkpoints(self, job_id: str) -> list[CheckpointInfo]:
        """The job's complete checkpoints in its own folder, oldest first (none without a root)."""
        root = self.config.checkpoint_root
        return list_checkpoints(resuming.job_dir(root, job_id)) if root else []

    def wait_changed(self, seen: int, timeout: float) -> int:
        """Block until ``version`` is no longer ``seen`` (something changed) or ``timeout`` seconds
        pass; returns the version now. Read ``version`` before reading the store, then wait on it."""
        with self.changed:
            self.changed.wait_for(lambda: self.version != seen, timeout)
            return self.version

    @property
    def changed(self) -> threading.Condition:
        return self.feed.changed

    @property
    def version(self) -> int:
        """Grows on every change that a stream may be waiting for."""
        return self.feed.version

    def follow(
        self, job_id: str, after_seq: int = 0, active: Callable[[], bool] = lambda: True, poll: float = 1.0
    ) -> Iterator[sp.JobEvent]:
        """The job's events after ``after_seq`` as ``JobEvent`` messages, then new ones as they happen,
        until the one that ends the job (or ``active()`` turns false; checked every ``poll`` s). Woken by
        this job's changes only; its followers share one store read a change (``job_feed.py``)."""
        self.store.get(job_id)
        seq, last = after_seq, None
        with self.feed.following(job_id, after_seq):
            while active():
                seen = self.feed.job_version(job_id)
                events, ended = self.feed.read(job_id, seq, last, seen, poll)
                for ev in events:
                    yield ev
                    seq, last = ev.seq, ev.status
                    if ev.HasField("state_change") and ev.status.state in _TERMINAL_CODES:
                        return
                if ended:
                    return  # read before its events: they were all sent (or were before after_seq)
                self.feed.wait(job_id, seen, poll)

    @property
    def backend(self) -> str:
        return self.config.run.backend

    @property
    def checkpoint_root(self) -> str | None:
        return self.config.checkpoint_root

    def resize(self, running: RunningJob, slots: int) -> None:
        """``running`` holds ``slots`` device slots from its next attempt on: an elastic re-plan onto fewer
        ranks gives the rest to queued jobs (``elastic.py``); growing back takes them again."""
        with self._lock:
            running.slots = slots
        self._schedule()

    @property
    def used_slots(self) -> int:
        with self._lock:
            return sum(r.slots for r in self._running.values())

    # ---- scheduling -------------------------------------------------------------------------------

    def notify(self, job_id: str | None = None) -> None:
        """After a store write about ``job_id`` (None: one that may concern any job)."""
        self.feed.notify(job_id)

    def _schedule(self) -> None:
        """Start queued jobs, oldest first, while they fit; mark the rest as waiting."""
        with self._lock:
            if not self.ready:
                return
            free = self.capacity - sum(r.slots for r in self._running.values())
            while self._queue:
                job_id = self._queue[0]
                job = self._jobs[job_id]
                slots = len(job_ranks(job))
                if slots > free:
                    break
                self._queue.pop(0)
                del self._jobs[job_id]
                free -= slots
                self._start(job_id, job, slots, self._compiled.pop(job_id, None))
            for job_id in self._queue:
                slots = len(job_ranks(self._jobs[job_id]))
                self.store.set_reason(
                    job_id,
                    WAITING,
                    f"needs {slots} of the cluster's {self.capacity} slot(s); waits for running or "
                    "earlier jobs to finish",
                )
                self.notify(job_id)

    def _start(self, job_id: str, job: Job, slots: int, compiled: Compiled | None = None) -> None:
        r = RunningJob(job, slots, compiled)
        self._running[job_id] = r
        r.thread = threading.Thread(target=self._run, args=(job_id, r), name=f"job-{job_id}", daemon=True)
        r.thread.start()

    # ---- one job's run ----------------------------------------------------------------------------

    def last_checkpoint(self, job_id: str) -> str:
        """Path of the job's latest complete checkpoint (or of the one it started from); '' if none."""
        if self.config.checkpoint_root is None:
            return ""
        found = resuming.start_checkpoint(self.config.checkpoint_root, self.store.get(job_id))
        return "" if found is None else str(found.path)

    def _run(self, job_id: str, r: RunningJob) -> None:
        try:
            run_job(self, job_id, r, STORE_FLUSH_SECONDS)
        finally:
            with self._lock:
                del self._running[job_id]
            self._schedule()
            self.notify(job_id)

    def storage_failed(self, message: str) -> None:
        """A run's checkpoint write failed for its disk: not ready until the root takes a write again."""
        self.storage.failed(message)

    def unready_reason(self) -> str:
        """Why the manager should take no new work now ('' when it may): its checkpoint root is full or
        read-only (``/readyz`` answers 503 with this)."""
        return self.storage.problem()

    @property
    def closed(self) -> bool:
        """Shutting down (``shutdown``): a stopped run ends CANCELLED with ``CONTROL_PLANE_SHUTDOWN``."""
        return self._closed
