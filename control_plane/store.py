"""The control plane's job store: a SQLite file (WAL), so jobs and their history survive a restart.

Every change is one transaction that updates the ``jobs`` row and appends to ``events`` (a per-job
sequence number, so ``Watch`` can resume after the last event it sent); ``record_step`` also appends
to ``losses``. One connection, ``check_same_thread=False``, guarded by a lock: the gRPC server's
threads share it. The schema is created on open and stamped with ``PRAGMA user_version`` so that a
later version can migrate it. On restart, ``reconcile_after_restart`` marks the jobs that were in
flight FAILED with a reason, so none is silently lost.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from sbpflow.errors import SbpflowError

SCHEMA_VERSION = 1


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

RESTART_REASON = "control plane restarted"


def allowed(old: JobState, new: JobState) -> bool:
    """Whether the lifecycle lets a job go from ``old`` to ``new``."""
    if old in TERMINAL:
        return False
    return new in (JobState.FAILED, JobState.CANCELLED) or _NEXT.get(old) == new


class StoreError(SbpflowError):
    """A store operation that cannot be done (unknown job, bad arguments)."""


class UnknownJobError(StoreError, KeyError):
    """No job has this id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class IllegalTransitionError(StoreError, ValueError):
    """A state change the lifecycle does not allow; the message names both states."""


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    state: JobState
    reason: str
    message: str
    attempt: int
    step: int
    loss: float | None
    samples_per_second: float | None
    created: float
    updated: float
    started: float | None
    finished: float | None
    job_proto: bytes


@dataclass(frozen=True)
class JobEvent:
    job_id: str
    seq: int
    time: float
    kind: str  # "created", "state", "step"
    state: JobState
    reason: str
    message: str
    data: dict[str, object]


@dataclass(frozen=True)
class LossPoint:
    step: int
    loss: float
    samples_per_second: float
    time: float


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    attempt INTEGER NOT NULL DEFAULT 1,
    step INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    samples_per_second REAL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    started REAL,
    finished REAL,
    job_proto BLOB NOT NULL,
    last_seq INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    seq INTEGER NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    data TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS losses (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    step INTEGER NOT NULL,
    loss REAL NOT NULL,
    samples_per_second REAL NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (job_id, step)
);
"""

_COLUMNS = (
    "id, name, state, reason, message, attempt, step, loss, samples_per_second, created, updated, "
    "started, finished, job_proto"
)


def _record(row: Sequence[Any]) -> JobRecord:
    (
        id_,
        name,
        state,
        reason,
        message,
        attempt,
        step,
        loss,
        sps,
        created,
        updated,
        started,
        finished,
        blob,
    ) = row
    return JobRecord(
        id=str(id_),
        name=str(name),
        state=JobState(str(state)),
        reason=str(reason),
        message=str(message),
        attempt=int(attempt),
        step=int(step),
        loss=None if loss is None else float(loss),
        samples_per_second=None if sps is None else float(sps),
        created=float(created),
        updated=float(updated),
        started=None if started is None else float(started),
        finished=None if finished is None else float(finished),
        job_proto=bytes(blob),
    )


class JobStore:
    """Jobs, their events and loss history in one SQLite file; safe to share between threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.RLock()
        # isolation_level=None: autocommit; each change opens its own BEGIN IMMEDIATE ... COMMIT.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        with self._lock:
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                self._db.close()
                raise StoreError(
                    f"store {self.path} has schema version {version}, newer than this sbpflow's "
                    f"{SCHEMA_VERSION}; upgrade sbpflow or point --store at another file"
                )
            self._db.execute("BEGIN IMMEDIATE")
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    self._db.execute(stmt)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._db.execute("COMMIT")

    # ---- plumbing -------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tx(self) -> _Tx:
        return _Tx(self)

    def _append_event(
        self,
        job_id: str,
        kind: str,
        state: JobState,
        reason: str = "",
        message: str = "",
        data: dict[str, object] | None = None,
        now: float | None = None,
    ) -> int:
        seq = int(
            self._db.execute(
                "UPDATE jobs SET last_seq = last_seq + 1 WHERE id = ? RETURNING last_seq", (job_id,)
            ).fetchone()[0]
        )
        self._db.execute(
            "INSERT INTO events (job_id, seq, time, kind, state, reason, message, data) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (job_id, seq, now or time.time(), kind, str(state), reason, message, json.dumps(data or {})),
        )
        return seq

    def _get(self, job_id: str) -> JobRecord:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise UnknownJobError(f"no job with id {job_id!r}; `sbpflow status` lists the jobs")
        return _record(row)

    # ---- the API --------------------------------------------------------------------------------

    def create(self, job_proto_bytes: bytes, name: str) -> JobRecord:
        """Store a new job: a fresh id, PENDING, attempt 1, and its "created" event."""
        job_id = uuid.uuid4().hex[:16]
        now = time.time()
        with self._tx():
            self._db.execute(
                "INSERT INTO jobs (id, name, state, attempt, created, updated, job_proto) "
                "VALUES (?, ?, ?, 1, ?, ?, ?)",
                (job_id, name, str(JobState.PENDING), now, now, sqlite3.Binary(job_proto_bytes)),
            )
            self._append_event(job_id, "created", JobState.PENDING, now=now)
            return self._get(job_id)

    def get(self, job_id: str) -> JobRecord:
        with self._lock:
            return self._get(job_id)

    def list(
        self, states: Iterable[JobState | str] | None = None, limit: int = 100, offset: int = 0
    ) -> builtins.list[JobRecord]:
        """Jobs, newest first, optionally only those in ``states``."""
        if limit < 0 or offset < 0:
            raise StoreError(f"limit={limit}, offset={offset}: both must be >= 0")
        where, args = "", []
        if states is not None:
            names = [str(JobState(s)) for s in states]
            if not names:
                return []
            where = f"WHERE state IN ({', '.join('?' * len(names))})"
            args = list(names)
        sql = f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY created DESC, rowid DESC LIMIT ? OFFSET ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit, offset)).fetchall()
        return [_record(r) for r in rows]

    def count(self, states: Iterable[JobState | str] | None = None) -> int:
        with self._lock:
            if states is None:
                return int(self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
            names = [str(JobState(s)) for s in states]
            if not names:
                return 0
            q = f"SELECT COUNT(*) FROM jobs WHERE state IN ({', '.join('?' * len(names))})"
            return int(self._db.execute(q, names).fetchone()[0])

    def transition(
        self, job_id: str, new_state: JobState | str, reason: str = "", message: str = ""
    ) -> JobRecord:
        """Move a job to ``new_state`` (and append a "state" event) or raise ``IllegalTransitionError``."""
        new = JobState(new_state)
        now = time.time()
        with self._tx():
            old = self._get(job_id).state
            if not allowed(old, new):
                fwd = _NEXT.get(old)
                legal = (
                    "none: it is final"
                    if old in TERMINAL
                    else f"{fwd}, FAILED or CANCELLED".replace("JOB_STATE_", "")
                )
                raise IllegalTransitionError(
                    f"job {job_id!r} cannot go from {old.name} to {new.name}; from {old.name} the "
                    f"lifecycle allows {legal}"
                )
            self._db.execute(
                "UPDATE jobs SET state = ?, reason = ?, message = ?, updated = ?, "
                "started = CASE WHEN ? AND started IS NULL THEN ? ELSE started END, "
                "finished = CASE WHEN ? THEN ? ELSE finished END WHERE id = ?",
                (str(new), reason, message, now, new == JobState.RUNNING, now, new in TERMINAL, now, job_id),
            )
            self._append_event(job_id, "state", new, reason, message, {"from": str(old)}, now=now)
            return self._get(job_id)

    def record_step(self, job_id: str, step: int, loss: float, samples_per_second: float) -> None:
        """Record a completed step: the job's step/loss/throughput, the loss history and a "step" event."""
        now = time.time()
        with self._tx():
            rec = self._get(job_id)
            self._db.execute(
                "INSERT OR REPLACE INTO losses (job_id, step, loss, samples_per_second, time) "
                "VALUES (?, ?, ?, ?, ?)",
                (job_id, step, float(loss), float(samples_per_second), now),
            )
            self._db.execute(
                "UPDATE jobs SET step = MAX(step, ?), loss = CASE WHEN ? >= step THEN ? ELSE loss END, "
                "samples_per_second = CASE WHEN ? >= step THEN ? ELSE samples_per_second END, "
                "updated = ? WHERE id = ?",
                (step, step, float(loss), step, float(samples_per_second), now, job_id),
            )
            data: dict[str, object] = {
                "step": step,
                "loss": float(loss),
                "samples_per_second": float(samples_per_second),
            }
            self._append_event(job_id, "step", rec.state, data=data, now=now)

    def losses(self, job_id: str) -> builtins.list[LossPoint]:
        """The loss history, by step."""
        with self._lock:
            self._get(job_id)
            rows = self._db.execute(
                "SELECT step, loss, samples_per_second, time FROM losses WHERE job_id = ? ORDER BY step",
                (job_id,),
            ).fetchall()
        return [LossPoint(int(s), float(l), float(r), float(t)) for s, l, r, t in rows]

    def events(self, job_id: str, after_seq: int = 0) -> builtins.list[JobEvent]:
        """The job's events with ``seq > after_seq``, in order."""
        with self._lock:
            self._get(job_id)
            rows = self._db.execute(
                "SELECT seq, time, kind, state, reason, message, data FROM events "
                "WHERE job_id = ? AND seq > ? ORDER BY seq",
                (job_id, after_seq),
            ).fetchall()
        return [
            JobEvent(job_id, int(seq), float(t), str(kind), JobState(str(st)), str(r), str(m), json.loads(d))
            for seq, t, kind, st, r, m, d in rows
        ]

    def reconcile_after_restart(self) -> builtins.list[JobRecord]:
        """Mark every job left COMPILING, STARTING or RUNNING by a previous process FAILED; return them.

        Call once on start-up, before scheduling anything. PENDING jobs stay PENDING (they will be
        scheduled again); terminal jobs are untouched.
        """
        names = [str(s) for s in IN_FLIGHT]
        now = time.time()
        with self._tx():
            ids = [
                str(r[0])
                for r in self._db.execute(
                    f"SELECT id FROM jobs WHERE state IN ({', '.join('?' * len(names))}) ORDER BY created",
                    names,
                ).fetchall()
            ]
            out = []
            for job_id in ids:
                old = self._get(job_id).state
                message = (
                    f"the job was {old.name} when the control plane stopped; its workers are gone. "
                    "Submit it again (it restarts from its last checkpoint, if any)"
                )
                self._db.execute(
                    "UPDATE jobs SET state = ?, reason = ?, message = ?, updated = ?, finished = ? WHERE id = ?",
                    (str(JobState.FAILED), RESTART_REASON, message, now, now, job_id),
                )
                self._append_event(
                    job_id, "state", JobState.FAILED, RESTART_REASON, message, {"from": str(old)}, now=now
                )
                out.append(self._get(job_id))
            return out


class _Tx:
    """``with store._tx():`` holds the lock and runs the body in one BEGIN IMMEDIATE ... COMMIT."""

    def __init__(self, store: JobStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        self._store._lock.acquire()
        try:
            self._store._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._store._lock.release()
            raise

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._store._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        finally:
            self._store._lock.release()
