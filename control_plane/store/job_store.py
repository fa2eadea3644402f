"""The control plane's job store: a SQLite file (WAL), so jobs and their history survive a restart.

Every change is one transaction that updates the ``jobs`` row and appends to ``events`` (a per-job
sequence number, so ``Watch`` can resume after the last event it sent); ``record_step`` also appends
to ``losses``. One connection, ``check_same_thread=False``, guarded by a lock: the gRPC server's
threads share it. The schema is created on open and stamped with ``PRAGMA user_version`` so that a
later version can migrate it. On restart, ``reconcile_after_restart`` puts each job that was in
flight back in the queue as a new attempt when it can resume from a checkpoint, and marks the others
FAILED with a reason, so none is silently lost. ``new_attempt`` records a restart (a lost worker): the
attempt column grows and a "state" event with the reason says why. The records and the schema are in
``store_schema.py``, the connection, its transactions and the store's errors in ``store_db.py``, the
workers, logs and results tables in ``store_tables.py``.
"""

from __future__ import annotations

import builtins
import json
import math
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sbpflow.control_plane.store.db import StoreError
from sbpflow.control_plane.store.schema import COLUMNS as _COLUMNS
from sbpflow.control_plane.store.schema import (
    JOBS,
    LIVE_STATES,
    JobEvent,
    JobRecord,
    LossPoint,
    loss_column,
    loss_from_column,
    record_from_row,
)
from sbpflow.control_plane.store.tables import JobSideTables
from sbpflow.runs.states import TERMINAL, JobState, allowed, legal_next

RESTART_REASON = "CONTROL_PLANE_RESTARTED"
RESUMED_REASON = "RESUMED_AFTER_RESTART"
CANCELLED_BY_USER = "CANCELLED_BY_USER"


class AlreadyResuming(StoreError):
    """A job that another job in flight (or queued) already resumes: at most one goes on from it."""


class IllegalTransitionError(StoreError, ValueError):
    """A state change the lifecycle does not allow; the message names both states."""


@dataclass(frozen=True)
class Resumable:
    """How a job that was in flight when the control plane stopped goes on: a new attempt from the
    checkpoint at ``step``; ``message`` says so (kept as the job's message)."""

    step: int
    message: str


class JobStore(JobSideTables):
    """Jobs, their events and loss history in one SQLite file; safe to share between threads."""

    # ---- the API --------------------------------------------------------------------------------

    def create(
        self,
        job_proto_bytes: bytes,
        name: str,
        *,
        client_id: str = "",
        idempotency_key: str = "",
        total_steps: int = 0,
        slots: int = 0,
        resumed_from: str = "",
        resume_checkpoint: str = "",
        options: bytes = b"",
    ) -> JobRecord:
        """Store a new job: a fresh id, PENDING, attempt 1, and its "created" event; ``options``: the
        serialized RunOptions its client set (kept with it, schema.py).

        With an ``idempotency_key``, a job already stored under the same (``client_id``, key) is
        returned instead, and nothing is written. ``resumed_from``/``resume_checkpoint``: the job (which
        must exist) and the checkpoint a resumed job starts from; ``AlreadyResuming`` when a job not yet
        ended already resumes it (checked here and, against other processes, by a unique index).
        """
        job_id = uuid.uuid4().hex[:16]
        now = time.time()
        with self._tx():
            if idempotency_key:
                row = self._db.execute(
                    f"SELECT {_COLUMNS} FROM {JOBS} WHERE client_id = ? AND idempotency_key = ?",
                    (client_id, idempotency_key),
                ).fetchone()
                if row is not None:
                    return record_from_row(row)
            if resumed_from:
                self._get(resumed_from)
                self._refuse_second_resume(resumed_from)
            self._db.execute(
                "INSERT INTO jobs (id, name, state, attempt, created, updated, job_proto, client_id, "
                "idempotency_key, total_steps, slots, resumed_from, resume_checkpoint, options) "
                "VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, name, str(JobState.PENDING), now, now, sqlite3.Binary(job_proto_bytes),
                 client_id, idempotency_key, total_steps, slots, resumed_from, resume_checkpoint,
                 sqlite3.Binary(options)),
            )  # fmt: skip
            data: dict[str, object] = {"resumed_from": resumed_from} if resumed_from else {}
            self._append_event(job_id, "created", JobState.PENDING, data=data, now=now)
            return self._get(job_id)

    def _refuse_second_resume(self, resumed_from: str) -> None:
        row = self._db.execute(
            f"SELECT id, state FROM jobs WHERE resumed_from = ? AND state IN {LIVE_STATES}", (resumed_from,)
        ).fetchone()
        if row is not None:
            raise AlreadyResuming(
                f"job {resumed_from} is already being resumed by job {row[0]} ({JobState(row[1]).name}); "
                f"follow that one (`sbpflow watch {row[0]}`), or cancel it before resuming again"
            )

    def find(self, client_id: str, idempotency_key: str) -> JobRecord | None:
        """The job stored under (``client_id``, ``idempotency_key``), if any."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM {JOBS} WHERE client_id = ? AND idempotency_key = ?",
                (client_id, idempotency_key),
            ).fetchone()
        return None if row is None else record_from_row(row)

    def request_cancel(self, job_id: str, message: str) -> JobRecord:
        """Store a Cancel of a job not yet ended (before it is acknowledged): if the control plane stops
        before the run does, the next one ends the job CANCELLED rather than resume it."""
        with self._tx():
            rec = self._get(job_id)
            if rec.state.terminal or rec.cancel_requested:
                return rec
            self._db.execute(
                "UPDATE jobs SET cancel_requested = ?, updated = ? WHERE id = ?",
                (message, time.time(), job_id),
            )
            return self._get(job_id)

    def set_reason(self, job_id: str, reason: str, message: str = "") -> JobRecord:
        """Change the reason/message of a job that keeps its state (e.g. PENDING "WAITING_FOR_RESOURCES");
        appends a "reason" event only when something changed. A terminal job is left as it is."""
        with self._tx():
            rec = self._get(job_id)
            if rec.state.terminal or (rec.reason, rec.message) == (reason, message):
                return rec
            self._db.execute(
                "UPDATE jobs SET reason = ?, message = ?, updated = ? WHERE id = ?",
                (reason, message, time.time(), job_id),
            )
            self._append_event(job_id, "reason", rec.state, reason, message)
            return self._get(job_id)

    def get(self, job_id: str) -> JobRecord:
        with self._lock:
            return self._get(job_id)

    def list(
        self,
        states: Iterable[JobState | str] | None = None,
        limit: int = 100,
        offset: int = 0,
        name_contains: str = "",
    ) -> builtins.list[JobRecord]:
        """Jobs, newest first, optionally only those in ``states`` and those whose name contains
        ``name_contains`` (ASCII letters in either case)."""
        if limit < 0 or offset < 0:
            raise StoreError(f"limit={limit}, offset={offset}: both must be >= 0")
        conditions, args = [], []
        if states is not None:
            names = [str(JobState(s)) for s in states]
            if not names:
                return []
            conditions.append(f"state IN ({', '.join('?' * len(names))})")
            args = list(names)
        if name_contains:
            conditions.append("instr(lower(name), lower(?)) > 0")
            args.append(name_contains)
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        sql = f"SELECT {_COLUMNS} FROM {JOBS} {where} ORDER BY created DESC, jobs.rowid DESC LIMIT ? OFFSET ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit, offset)).fetchall()
        return [record_from_row(r) for r in rows]

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
                legal = legal_next(old)
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

    def new_attempt(
        self, job_id: str, attempt: int, state: JobState, reason: str, message: str, step: int
    ) -> JobRecord:
        """Start attempt ``attempt`` of a job in flight: it goes (back) to ``state`` (STARTING when its
        run restarts it, PENDING when it waits for the queue) from the checkpoint at ``step``, which
        becomes its step; one "state" event with ``reason`` and ``message`` says so. The losses after
        ``step`` go: those steps run again, and only the new attempt's count (``losses``, the jobs page)."""
        state, now = JobState(state), time.time()
        with self._tx():
            rec = self._get(job_id)
            if rec.state.terminal or state not in (JobState.PENDING, JobState.STARTING):
                raise IllegalTransitionError(
                    f"job {job_id!r} is {rec.state.name}: a new attempt starts only for a job in flight, "
                    f"and goes to PENDING or STARTING (not {state.name})"
                )
            if attempt <= rec.attempt:
                raise StoreError(
                    f"job {job_id!r} is on attempt {rec.attempt}; a new attempt is numbered above it, "
                    f"not {attempt}"
                )
            self._db.execute(
                "UPDATE jobs SET state = ?, attempt = ?, reason = ?, message = ?, step = ?, updated = ? "
                "WHERE id = ?",
                (str(state), attempt, reason, message, step, now, job_id),
            )
            self._db.execute("DELETE FROM losses WHERE job_id = ? AND step > ?", (job_id, step))
            data: dict[str, object] = {"from": str(rec.state), "attempt": attempt, "step": step}
            self._append_event(job_id, "state", state, reason, message, data, now=now)
            return self._get(job_id)

    def record_eval(self, job_id: str, step: int, loss: float) -> None:
        """Record an evaluation on the held-out split: an "eval" event (the status page's curve) and the
        job's latest (a later step's replaces an earlier's)."""
        now = time.time()
        with self._tx():
            rec = self._get(job_id)
            self._db.execute(
                "UPDATE jobs SET eval_step = ?, eval_loss = ?, updated = ? WHERE id = ? AND eval_step <= ?",
                (step, loss_column(loss), now, job_id, step),
            )
            self._append_event(job_id, "eval", rec.state, data={"step": step, "loss": float(loss)}, now=now)

    def record_step(
        self,
        job_id: str,
        step: int,
        loss: float,
        samples_per_second: float,
        step_seconds: float = 0.0,
        scaling: tuple[float, int] | None = None,
    ) -> None:
        """Record a completed step: the job's step/loss/throughput, the loss history and a "step" event.
        A NaN or infinite loss is kept as it is (see ``schema``: NaN is NULL plus a flag in SQLite).
        ``scaling``: dynamic loss scaling's scale after the step and its steps skipped so far."""
        now = time.time()
        value, nan = loss_column(loss), math.isnan(loss)
        with self._tx():
            rec = self._get(job_id)
            self._db.execute(
                "INSERT OR REPLACE INTO losses (job_id, step, loss, samples_per_second, time) "
                "VALUES (?, ?, ?, ?, ?)",
                (job_id, step, value, float(samples_per_second), now),
            )
            self._db.execute(
                "UPDATE jobs SET step = MAX(step, ?), loss = CASE WHEN ? >= step THEN ? ELSE loss END, "
                "loss_nan = CASE WHEN ? >= step THEN ? ELSE loss_nan END, "
                "samples_per_second = CASE WHEN ? >= step THEN ? ELSE samples_per_second END, "
                "updated = ? WHERE id = ?",
                (step, step, value, step, nan, step, float(samples_per_second), now, job_id),
            )
            data: dict[str, object] = {
                "step": step,
                "loss": float(loss),
                "samples_per_second": float(samples_per_second),
                "step_seconds": float(step_seconds),
            }
            if scaling is not None:
                data["loss_scale"], data["skipped_steps"] = float(scaling[0]), int(scaling[1])
                self._db.execute(
                    "INSERT OR REPLACE INTO loss_scaling (job_id, loss_scale, skipped_steps) VALUES (?, ?, ?)",
                    (job_id, float(scaling[0]), int(scaling[1])),
                )
            self._append_event(job_id, "step", rec.state, data=data, now=now)

    def losses(self, job_id: str) -> builtins.list[LossPoint]:
        """The loss history, by step."""
        with self._lock:
            self._get(job_id)
            rows = self._db.execute(
                "SELECT step, loss, samples_per_second, time FROM losses WHERE job_id = ? ORDER BY step",
                (job_id,),
            ).fetchall()
        return [LossPoint(int(s), float(loss_from_column(l)), float(r), float(t)) for s, l, r, t in rows]

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

    def reconcile_after_restart(
        self, resumable: Callable[[JobRecord], Resumable | None] = lambda rec: None
    ) -> builtins.list[JobRecord]:
        """Settle every job a previous process left COMPILING, STARTING or RUNNING; return them.

        A job with a stored Cancel (``request_cancel``; PENDING ones too) ends CANCELLED
        (``CANCELLED_BY_USER``) and is never resumed. Otherwise a job for which ``resumable(rec)`` says how to go on becomes PENDING again as its next attempt
        (reason ``RESUMED_AFTER_RESTART``), to be scheduled with the others; every other one is marked
        FAILED (reason ``CONTROL_PLANE_RESTARTED``). Call once on start-up, before scheduling anything.
        PENDING jobs stay PENDING; terminal jobs are untouched.
        """
        with self._lock:
            ids = [
                str(r[0])
                for r in self._db.execute(
                    f"SELECT id FROM jobs WHERE state IN {LIVE_STATES} AND (state != ? OR cancel_requested != '') "
                    "ORDER BY created",
                    (str(JobState.PENDING),),
                ).fetchall()
            ]
        out = []
        for job_id in ids:
            rec = self.get(job_id)
            how = None if rec.cancel_requested else resumable(rec)
            if rec.cancel_requested:
                out.append(
                    self.transition(job_id, JobState.CANCELLED, CANCELLED_BY_USER, rec.cancel_requested)
                )
            elif how is not None:
                out.append(
                    self.new_attempt(
                        job_id, rec.attempt + 1, JobState.PENDING, RESUMED_REASON, how.message, how.step
                    )
                )
            else:
                out.append(self._fail_after_restart(job_id))
        return out

    def _fail_after_restart(self, job_id: str) -> JobRecord:
        now = time.time()
        with self._tx():
            old = self._get(job_id).state
            message = (
                f"the job was {old.name} when the control plane stopped; its workers are gone and it has "
                "no checkpoint to resume from. Submit it again"
            )
            self._db.execute(
                "UPDATE jobs SET state = ?, reason = ?, message = ?, updated = ?, finished = ? WHERE id = ?",
                (str(JobState.FAILED), RESTART_REASON, message, now, now, job_id),
            )
            self._append_event(
                job_id, "state", JobState.FAILED, RESTART_REASON, message, {"from": str(old)}, now=now
            )
            return self._get(job_id)
