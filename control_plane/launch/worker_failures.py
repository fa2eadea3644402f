"""What a Ray worker's failure is, as the scheduler sees it: a lost worker, an exception raised in one
(carried back as text), and which of several ranks' failures caused the others (:func:`primary`).
"""

from __future__ import annotations

from typing import Any

from sbpflow.actor_workers.runtime.errors import RuntimeFailure
from sbpflow.errors import SbpflowError


class WorkerLost(SbpflowError):
    """A worker process died (killed, out of memory, its node gone)."""


def failure_of(f: Any) -> RuntimeFailure:
    cause = WorkerError(f"{f.cause_type}: {f.cause}", f.cause_type, f.traceback)
    return RuntimeFailure(f.rank, f.actor, f.op, cause, f.iteration)


class WorkerError(SbpflowError):
    """An exception raised in a worker process, carried back as text (type, message, traceback)."""

    def __init__(self, message: str, cause_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.cause_type = cause_type
        self.remote_traceback = remote_traceback


# The failure to report when several ranks fail: the one that caused the others.
_ECHO_CAUSES = ("TransportError", "TransportAborted", "RuntimeAborted")


def primary(failures: list[RuntimeFailure]) -> RuntimeFailure:
    def rank(f: RuntimeFailure) -> int:
        if isinstance(f.cause, WorkerLost):
            return 0
        return 2 if echoes(f) else 1

    return min(failures, key=rank)


def echoes(f: RuntimeFailure) -> bool:
    """Whether ``f`` only echoes another rank's failure (its transport broke, it was aborted)."""
    return getattr(f.cause, "cause_type", type(f.cause).__name__) in _ECHO_CAUSES
