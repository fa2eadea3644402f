"""Graceful drain: how ``sbpflow server`` leaves on SIGTERM (a rolling update of the control plane).

    drained = drain(manager, grace=25.0)   # admits nothing more; saves what it can; stops the runs
    drained.saved                           # {job id: the checkpoint step the next server resumes from}

Rules:
- from the first moment, Submit and Resume are refused with UNAVAILABLE (:class:`Draining`) and
  ``/readyz`` answers 503, so a load balancer sends new work to another server;
- a running job that checkpoints goes on until it completes a checkpoint later than the one it had when
  the drain began (or ends by itself), then its run is stopped. Its record stays in flight with reason
  ``CONTROL_PLANE_DRAINED``, and the next server on the same store queues it again as its next attempt
  from that checkpoint (``RESUMED_AFTER_RESTART``, :meth:`JobStore.reconcile_after_restart`);
- a job cancelled while the drain runs (its Cancel stored, ``JobStore.request_cancel``) ends CANCELLED,
  here or, if the drain stopped its run first, when the next server reconciles the store: never resumed;
- a job that cannot be saved (no checkpoint root, ``checkpoint_every`` 0) runs on until the grace
  period ends, in case it finishes; the next server fails it with ``CONTROL_PLANE_RESTARTED``;
- everything is bounded by ``grace`` seconds, plus :data:`STOP_SECONDS` for the stopped runs' threads
  to unwind; PENDING jobs stay PENDING for the next server.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from sbpflow.checkpoint.read import latest
from sbpflow.control_plane.service import resume as resuming
from sbpflow.control_plane.service.running import Manager, RunningJob
from sbpflow.errors import SbpflowError

DRAINED = "CONTROL_PLANE_DRAINED"
STOP_SECONDS = 10.0  # after the grace period: how long the stopped runs' threads get to unwind
POLL_SECONDS = 0.05


class Draining(SbpflowError):
    """The control plane is draining: it admits no new job (gRPC UNAVAILABLE, a retry elsewhere helps)."""

    def __init__(self, what: str = "job") -> None:
        super().__init__(
            f"the control plane is draining (it got SIGTERM) and admits no new {what}; submit to another "
            "server or retry in a few seconds: the next server resumes this one's jobs"
        )


@dataclass(frozen=True)
class Drained:
    """What a drain did: jobs it saved (id -> the checkpoint step they resume from), jobs it stopped
    without a checkpoint to go on from, jobs that ended by themselves while it waited, and its seconds."""

    saved: dict[str, int]
    unsaved: tuple[str, ...]
    ended: tuple[str, ...]
    seconds: float


def _checkpoint_step(manager: Manager, job_id: str, r: RunningJob) -> int | None:
    """The step of the job's latest complete checkpoint in its own folder (0: none yet); None when the
    job cannot checkpoint at all."""
    root = manager.checkpoint_root
    if root is None or r.job.config.checkpoint_every <= 0:
        return None
    found = latest(resuming.job_dir(root, job_id))
    return 0 if found is None else found.step


def drain(manager: Manager, grace: float, poll: float = POLL_SECONDS) -> Drained:
    """Stop admitting, let each running job reach its next checkpoint within ``grace`` seconds, then stop
    every run that is left without ending its job (see the module's rules)."""
    if grace < 0:
        raise ValueError(f"grace={grace}: give the drain 0 or more seconds (--drain-grace)")
    t0 = time.monotonic()
    deadline = t0 + grace
    running = manager.begin_drain()
    before = {job_id: _checkpoint_step(manager, job_id, r) for job_id, r in running.items()}
    saved: dict[str, int] = {}
    ended: list[str] = []
    while True:
        for job_id, r in running.items():
            if job_id in saved or job_id in ended:
                continue
            if r.thread is not None and not r.thread.is_alive():
                ended.append(job_id)
                continue
            step = _checkpoint_step(manager, job_id, r)
            was = before[job_id]
            if step is not None and was is not None and step > was:
                saved[job_id] = step
                _stop(manager, job_id, r, step)
        waiting = set(running) - set(saved) - set(ended)
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    for job_id in sorted(waiting):
        step = _checkpoint_step(manager, job_id, running[job_id])
        if step:  # an older checkpoint still saves what came before it
            saved[job_id] = step
        _stop(manager, job_id, running[job_id], step or 0)
    _join(running.values(), time.monotonic() + STOP_SECONDS)
    unsaved = tuple(sorted(waiting - set(saved)))
    return Drained(saved, unsaved, tuple(ended), time.monotonic() - t0)


def _stop(manager: Manager, job_id: str, r: RunningJob, step: int) -> None:
    """Stop one job's run, its record left in flight for the next server."""
    if step:
        note = f"the control plane drained; the next one resumes the job from its checkpoint at step {step}"
    else:
        note = "the control plane drained before the job had a checkpoint; its progress is lost"
    r.drained = True
    r.cancel_message = note
    manager.store.set_reason(job_id, DRAINED, note)
    manager.store.append_log(job_id, -1, "WARNING", note)
    r.cancel.set()


def _join(runs: Iterable[RunningJob], until: float) -> None:
    for r in runs:
        if r.thread is not None:
            r.thread.join(max(0.0, until - time.monotonic()))
