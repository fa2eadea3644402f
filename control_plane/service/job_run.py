"""One job's run on the job manager's thread for it, and the reason it ends with.

    run_job(manager, job_id, running, flush_seconds)   # on the job's own thread (``jobs.JobManager``)

The run compiles the job (or takes Submit's compile), lowers and launches it (``launcher.launch``) with
the job's listeners (``run_listeners.py``), and ends the job's record:

- SUCCEEDED with its result saved; FAILED with a machine-readable reason (``NON_FINITE_*``, a worker's
  ``WORKER_ERROR``, ``RUN_ERROR``, or the reason the failure's cause names in
  :data:`~sbpflow.control_plane.service.data_policy.FAILURE_REASONS`, ``CHECKPOINT_STORAGE_FULL`` and
  ``_READ_ONLY`` among them: those also make the manager not ready until its checkpoint root takes a
  write again, ``job_checkpoints.StorageProbe``);
- CANCELLED by a user's Cancel (``CANCELLED_BY_USER``) or the manager's shutdown
  (``CONTROL_PLANE_SHUTDOWN``). A run that ends in any way while its cancel is set (a compile that gave
  up, say) ends CANCELLED, never FAILED;
- a bug is ``INTERNAL``, its traceback kept in the job's log: a job is never lost;
- a run stopped by a drain (SIGTERM, ``drain.py``) leaves its job in flight for the next control plane,
  unless a Cancel was stored for it (``JobStore.request_cancel``): then it ends CANCELLED here, and a
  restarted control plane would end it so too (``reconcile_after_restart``).
"""

from __future__ import annotations

import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sbpflow.actor_workers.runtime.errors import RunCancelled, RuntimeFailure
from sbpflow.checkpoint.write import STORAGE_ERRORS, make_dir, storage_error
from sbpflow.control_plane.service.data_policy import reason_of
from sbpflow.control_plane.service.job_checkpoints import run_checkpoints
from sbpflow.control_plane.service.job_options import for_run
from sbpflow.control_plane.service.run_listeners import RunListeners
from sbpflow.control_plane.service.running import Manager, RunningJob
from sbpflow.control_plane.store.job_store import CANCELLED_BY_USER
from sbpflow.errors import SbpflowError
from sbpflow.limits import CompileBudget, Limits
from sbpflow.runs.numerics import NonFinite
from sbpflow.runs.options import RunOptions
from sbpflow.runs.states import JobState

if TYPE_CHECKING:
    from sbpflow.control_plane.launch.run_context import RunResult
    from sbpflow.control_plane.service.data_policy import DataPolicy

SHUTDOWN = "CONTROL_PLANE_SHUTDOWN"
STORAGE_REASONS = frozenset(c.reason for c in STORAGE_ERRORS.values())  # the manager is not ready after one
__all__ = ["CANCELLED_BY_USER", "SHUTDOWN", "RunHost", "run_job"]


class RunConfig(Protocol):
    """What a run reads of the manager's configuration (``jobs.ManagerConfig``)."""

    @property
    def run(self) -> RunOptions: ...
    @property
    def checkpoint_root(self) -> str | None: ...
    @property
    def data_policy(self) -> DataPolicy | None: ...
    @property
    def tensorboard_dir(self) -> str | None: ...
    @property
    def keep_run_results(self) -> bool: ...
    @property
    def limits(self) -> Limits: ...


class RunHost(Manager, Protocol):
    """The job manager as a run sees it."""

    @property
    def config(self) -> RunConfig: ...
    @property
    def report_hub(self) -> Any: ...
    @property
    def closed(self) -> bool:
        """The manager is shutting down: a stopped run ends CANCELLED with ``SHUTDOWN``."""
        ...

    @property
    def run_results(self) -> dict[str, RunResult]: ...

    def storage_failed(self, message: str) -> None:
        """A run could not write its checkpoint for its disk: not ready until a write there succeeds."""


def _compile_again(job: Any, limits: Limits, cancel: threading.Event) -> Any:
    """A re-queued job's compile (Submit's was lost with its server), sized and budgeted under the same
    limits as at Submit: over one it fails ``COMPILE_LIMIT``, a Cancel stops it at the next check."""
    from sbpflow.control_plane.compiler import pipeline, plan_size

    compiled = pipeline.compile(job, lower="none", budget=CompileBudget.start(limits, cancel))
    plan_size.check(compiled.state, limits)
    return compiled


def run_job(m: RunHost, job_id: str, r: RunningJob, flush_seconds: float) -> None:
    """Run one job to its end (see the module's rules); its held store writes are retried for at most
    ``flush_seconds`` at the end."""
    from sbpflow.control_plane.launch.launcher import launch
    from sbpflow.control_plane.launch.run_context import RunRequest

    rec = m.store.get(job_id)
    checkpoints = run_checkpoints(m.config.checkpoint_root, m.store, rec)
    listeners = RunListeners(m, job_id, r, checkpoints.step)
    # a restart goes on from a checkpoint: without any, a job does not restart
    base = for_run(m.config.run, rec.options)  # the server's, with what the job's client set
    how = base if checkpoints.checkpoint_dir else base.replace(max_restarts=0)
    policy = m.config.data_policy
    try:
        listeners.on_state(JobState.COMPILING)
        # Submit's compile; a job re-queued by a restarted control plane is compiled again from its Job
        if policy is not None:  # a re-queued job was checked under the roots of its day; every file is
            r.job = policy.bind(r.job)  # checked again as the workers open it (data_policy.py)
            how = how.replace(data_roots=policy.run_roots)
        compiled = r.compiled or _compile_again(r.job, m.config.limits, r.cancel)
        if checkpoints.checkpoint_dir:  # a read-only or full root: CHECKPOINT_STORAGE_*, before any work
            make_dir(checkpoints.checkpoint_dir)
        if r.cancel.is_set():  # cancelled while it compiled
            raise RunCancelled(r.cancel_message)
        asked = RunRequest(
            options=how,
            checkpoint_dir=checkpoints.checkpoint_dir,
            resume_from=checkpoints.resume_from,
            tensorboard_dir=m.config.tensorboard_dir,
            cancel=r.cancel,
            report_hub=m.report_hub,
            job_id=job_id,
            attempt=rec.attempt,
        )
        result = launch(compiled, listeners.heard_by(asked))
    except Exception as e:
        ended = _ending(m, job_id, r, e)
        if ended is None:  # drained: in flight for the next server, which resumes it from its checkpoint
            return
        if ended[1] == "INTERNAL":  # a bug: keep the traceback in the job's log, never lose the job
            listeners.write(m.store.append_log, job_id, -1, "ERROR", traceback.format_exc())
        if ended[1] in STORAGE_REASONS:
            m.storage_failed(ended[2])
        listeners.finish(*ended)
    else:
        from sbpflow.control_plane.status.records import result_proto

        def save() -> None:  # queued: the store's loss history is whole by the time it runs
            history = [p.loss for p in m.store.losses(job_id)]
            m.store.save_result(job_id, result_proto(job_id, result, history).SerializeToString())

        listeners.write(save)
        if m.config.keep_run_results:
            m.run_results[job_id] = result
        listeners.finish(JobState.SUCCEEDED, "", f"{len(result.losses)} steps in {result.seconds:.2f} s")
    finally:
        listeners.close(list(r.workers.values()), flush_seconds)


def _ending(m: RunHost, job_id: str, r: RunningJob, e: Exception) -> tuple[JobState, str, str] | None:
    """How a run that raised ``e`` ends its job: (state, reason, message); None: it stays in flight."""
    try:
        asked = m.store.get(job_id).cancel_requested  # a Cancel is stored before it is acknowledged
    except Exception:  # a store closed under a stopping server: the next one reads the Cancel (reconcile)
        asked = ""
    if asked:  # even when a drain stopped the run too: a cancelled job is never resumed
        return JobState.CANCELLED, CANCELLED_BY_USER, asked
    if r.drained:
        return None
    if isinstance(e, RunCancelled) or r.cancel.is_set():  # whatever a stopped run raised on its way out
        return JobState.CANCELLED, SHUTDOWN if m.closed else CANCELLED_BY_USER, r.cancel_message
    if isinstance(e, NonFinite):  # NON_FINITE_LOSS (the step's loss is stored) or NON_FINITE_PARAMETERS
        return JobState.FAILED, e.reason, str(e)
    if isinstance(e, RuntimeFailure):
        return JobState.FAILED, reason_of(e, "WORKER_ERROR"), str(e)
    if isinstance(e, SbpflowError):
        return JobState.FAILED, reason_of(e, "RUN_ERROR"), str(e)
    root, where = m.config.checkpoint_root, getattr(e, "filename", None)
    if (
        isinstance(e, OSError)
        and root
        and where
        and Path(where).absolute().is_relative_to(Path(root).absolute())
    ):
        err = storage_error(e, Path(where).parent)  # a file under the checkpoint root: its disk's fault
        return JobState.FAILED, err.reason, str(err)
    return JobState.FAILED, "INTERNAL", f"{type(e).__name__}: {e}"
