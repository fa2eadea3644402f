"""The lifecycle of a job run, from core so that every layer speaks of states in one vocabulary.

    PENDING -> COMPILING -> STARTING -> RUNNING -> SUCCEEDED
    (from any non-final state) -> FAILED | CANCELLED

A restarted attempt goes back to STARTING. The values are service.proto's ``JobState`` names, so a
state converts to and from the wire by name, and the job store keeps them as text.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """The lifecycle states; values are service.proto's ``JobState`` names."""

    PENDING = "JOB_STATE_PENDING"
    COMPILING = "JOB_STATE_COMPILING"
    STARTING = "JOB_STATE_STARTING"
    RUNNING = "JOB_STATE_RUNNING"
    SUCCEEDED = "JOB_STATE_SUCCEEDED"
    FAILED = "JOB_STATE_FAILED"
    CANCELLED = "JOB_STATE_CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
IN_FLIGHT = (JobState.COMPILING, JobState.STARTING, JobState.RUNNING)

# The forward path; from any non-final state a job may also go to FAILED or CANCELLED.
_NEXT = {
    JobState.PENDING: JobState.COMPILING,
    JobState.COMPILING: JobState.STARTING,
    JobState.STARTING: JobState.RUNNING,
    JobState.RUNNING: JobState.SUCCEEDED,
}


def allowed(old: JobState, new: JobState) -> bool:
    """Whether the lifecycle lets a job go from ``old`` to ``new``."""
    if old in TERMINAL:
        return False
    return new in (JobState.FAILED, JobState.CANCELLED) or _NEXT.get(old) == new


def legal_next(old: JobState) -> str:
    """The states ``old`` may go to, in words, for an error message."""
    if old in TERMINAL:
        return "none: it is final"
    return f"{_NEXT[old].name}, FAILED or CANCELLED"


class WorkerState(StrEnum):
    """A worker's lifecycle; values are service.proto's ``WorkerState`` names."""

    STARTING = "WORKER_STATE_STARTING"
    RUNNING = "WORKER_STATE_RUNNING"
    DONE = "WORKER_STATE_DONE"
    FAILED = "WORKER_STATE_FAILED"
    LOST = "WORKER_STATE_LOST"
    CANCELLED = "WORKER_STATE_CANCELLED"
