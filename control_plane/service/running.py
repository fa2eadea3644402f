"""A job the job manager is running, and what the parts around a run ask of the manager.

``jobs.JobManager`` keeps one :class:`RunningJob` per job in flight; a run's listeners
(``run_listeners.py``) and a drain (``drain.py``) hold one too, and reach the manager only through
:class:`Manager`, so that neither imports the manager that imports them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

from sbpflow.control_plane.compiler.pipeline import Compiled
from sbpflow.control_plane.status.metrics import Metrics
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.job import Job


@dataclass
class RunningJob:
    """A job being run: its slots, its thread, how to stop it, and its live per-worker rows."""

    job: Job
    slots: int
    compiled: Compiled | None = None  # Submit's compile (graph passes); None after a restart re-queued it
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_message: str = ""
    workers: dict[int, WorkerRecord] = field(default_factory=dict)
    thread: threading.Thread | None = None
    drained: bool = False  # stopped by a drain: the job stays in flight for the next server (drain.py)


class Manager(Protocol):
    """What a run's listeners and a drain ask of the job manager (``jobs.JobManager`` has it)."""

    @property
    def store(self) -> JobStore: ...
    @property
    def metrics(self) -> Metrics | None: ...
    @property
    def backend(self) -> str: ...
    @property
    def checkpoint_root(self) -> str | None: ...

    def notify(self, job_id: str | None = None) -> None:
        """After a store write about ``job_id`` (None: one that may concern any job)."""

    def resize(self, running: RunningJob, slots: int) -> None:
        """``running`` holds ``slots`` device slots from its next attempt on."""

    def begin_drain(self) -> dict[str, RunningJob]:
        """Admit and start nothing more; the running jobs."""
        ...
