"""What the job store keeps beside each job's row and events: its workers, its log and its result.

One row per rank of a job (``workers``, replaced as the rank reports), the job's log lines (``logs``,
numbered per job) and the serialised ``JobResult`` of a finished job (``results``). Every write is one
transaction of :class:`~sbpflow.control_plane.store.db.StoreDb` and refuses an unknown job id with
:class:`~sbpflow.control_plane.store.db.UnknownJobError`, as do the reads of logs and results.
"""

from __future__ import annotations

import builtins
import sqlite3
import time

from sbpflow.control_plane.store.db import StoreDb
from sbpflow.control_plane.store.schema import LogRecord, WorkerRecord
from sbpflow.runs.states import WorkerState


class JobSideTables(StoreDb):
    """The ``workers``, ``logs`` and ``results`` tables of the job store."""

    def upsert_worker(self, w: WorkerRecord) -> None:
        """Insert or replace the row of one rank of a job."""
        with self._tx():
            self._get(w.job_id)
            self._db.execute(
                "INSERT OR REPLACE INTO workers (job_id, rank, worker_id, state, host, step, last_heartbeat) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (w.job_id, w.rank, w.worker_id, str(w.state), w.host, w.step, w.last_heartbeat),
            )
            self._db.execute(
                "INSERT OR REPLACE INTO worker_usage (job_id, rank, cpu_seconds, rss_bytes) VALUES (?, ?, ?, ?)",
                (w.job_id, w.rank, float(w.cpu_seconds), int(w.rss_bytes)),
            )

    def workers(self, job_id: str) -> builtins.list[WorkerRecord]:
        """The job's workers, by rank (empty before it starts)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT w.rank, worker_id, state, host, step, last_heartbeat, cpu_seconds, rss_bytes "
                "FROM workers w LEFT JOIN worker_usage u ON u.job_id = w.job_id AND u.rank = w.rank "
                "WHERE w.job_id = ? ORDER BY w.rank",
                (job_id,),
            ).fetchall()
        return [
            WorkerRecord(
                job_id,
                int(r),
                str(wid),
                WorkerState(str(st)),
                str(h),
                int(s),
                float(hb),
                float(cpu or 0),
                int(rss or 0),
            )
            for r, wid, st, h, s, hb, cpu, rss in rows
        ]

    def append_log(self, job_id: str, rank: int, level: str, text: str, when: float | None = None) -> int:
        """Append a line to the job's log; returns its seq."""
        with self._tx():
            self._get(job_id)
            seq = 1 + int(
                self._db.execute(
                    "SELECT COALESCE(MAX(seq), 0) FROM logs WHERE job_id = ?", (job_id,)
                ).fetchone()[0]
            )
            self._db.execute(
                "INSERT INTO logs (job_id, seq, rank, time, level, text) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, seq, rank, when or time.time(), level, text),
            )
            return seq

    def logs(self, job_id: str, rank: int = -1, after_seq: int = 0) -> builtins.list[LogRecord]:
        """The job's log lines after ``after_seq``; ``rank`` >= 0 keeps only that rank's lines."""
        with self._lock:
            self._get(job_id)
            rows = self._db.execute(
                "SELECT seq, rank, time, level, text FROM logs WHERE job_id = ? AND seq > ? "
                "AND (? < 0 OR rank = ?) ORDER BY seq",
                (job_id, after_seq, rank, rank),
            ).fetchall()
        return [LogRecord(job_id, int(q), int(r), float(t), str(lv), str(x)) for q, r, t, lv, x in rows]

    def save_result(self, job_id: str, data: bytes) -> None:
        """Keep what a finished job produced (a serialised ``sbpflow.v1.JobResult``)."""
        with self._tx():
            self._get(job_id)
            self._db.execute(
                "INSERT OR REPLACE INTO results (job_id, data) VALUES (?, ?)", (job_id, sqlite3.Binary(data))
            )

    def result(self, job_id: str) -> bytes | None:
        """The saved result of a job, or None if it has none."""
        with self._lock:
            self._get(job_id)
            row = self._db.execute("SELECT data FROM results WHERE job_id = ?", (job_id,)).fetchone()
        return None if row is None else bytes(row[0])
