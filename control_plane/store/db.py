"""The database under the job store: one SQLite connection, its lock, transactions, and two helpers.

:class:`StoreDb` opens the file (WAL; a ``:memory:`` store for tests), creates the schema of
``store_schema.py`` or migrates an older file in place, and refuses a file newer than this sbpflow.
``with self._tx():`` holds the lock and runs its body in one ``BEGIN IMMEDIATE ... COMMIT`` (a
``ROLLBACK`` when the body raises). ``_get`` reads one job's row, ``_append_event`` appends the job's
next event (its per-job sequence number grows by one). :class:`~sbpflow.control_plane.store.job_store.JobStore`
builds the store's API on these.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Self

from sbpflow.control_plane.store.schema import COLUMNS as _COLUMNS
from sbpflow.control_plane.store.schema import (
    JOBS,
    MIGRATIONS,
    SCHEMA,
    SCHEMA_VERSION,
    JobRecord,
    record_from_row,
)
from sbpflow.errors import SbpflowError
from sbpflow.runs.states import JobState


class StoreError(SbpflowError):
    """A store operation that cannot be done (unknown job, bad arguments)."""


class StoreUnavailable(SbpflowError):
    """The store cannot write (disk full, read-only, I/O error): UNAVAILABLE, and /readyz answers 503."""


class StoreUnopenable(StoreError):
    """The store's file cannot be opened as a job store (damaged, not one, no permission, a folder): the
    message names the file and what to do; ``sbpflow server`` prints it as one line."""


def _open_problem(path: str, error: BaseException) -> str:
    """Why ``path`` could not be opened as a job store, and what to do (``StoreUnopenable``'s message)."""
    p, folder = Path(path), Path(path).resolve().parent
    elsewhere = "or point --store at another file"
    if p.is_dir():
        return f"the job store {path} is a directory; point --store at a file in it (e.g. {p / 'jobs.db'})"
    if not folder.is_dir():
        return f"the folder {folder} of the job store {path} does not exist; create it {elsewhere}"
    if p.exists() and not os.access(p, os.R_OK | os.W_OK):
        return (
            f"the job store {path} cannot be read and written by this user (or its disk is read-only); fix "
            f"its permissions (chmod u+rw) or mount it writable, {elsewhere}"
        )
    if not os.access(folder, os.W_OK | os.X_OK):  # SQLite's WAL keeps two files beside the store
        return (
            f"the folder {folder} of the job store {path} is not writable (SQLite keeps {p.name}-wal and "
            "-shm there); "
            f"fix its permissions or mount it writable, {elsewhere}"
        )
    if isinstance(error, sqlite3.DatabaseError) and not isinstance(error, sqlite3.OperationalError):
        return (
            f"the job store {path} is damaged or not a job store (SQLite: {error}); restore it from a "
            f"backup, or move it aside (mv {path} {path}.broken) to start with an empty store"
        )
    return f"the job store {path} cannot be opened ({type(error).__name__}: {error}); check the file, {elsewhere}"


class UnknownJobError(StoreError, KeyError):
    """No job has this id."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StoreDb:
    """The job store's SQLite connection, shared between threads under one lock."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.RLock()
        self.write_error = ""  # why the last write failed; "" once one succeeds (/readyz)
        # isolation_level=None: autocommit; each change opens its own BEGIN IMMEDIATE ... COMMIT.
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        except (sqlite3.Error, OSError) as e:
            raise StoreUnopenable(_open_problem(self.path, e)) from None
        try:
            self._open()
        except (sqlite3.Error, OSError) as e:
            self._db.close()
            raise StoreUnopenable(_open_problem(self.path, e)) from None

    def _open(self) -> None:
        """Set the connection up; create the schema or migrate an older file in place."""
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
            for old in range(version or SCHEMA_VERSION, SCHEMA_VERSION):  # a new file needs none
                for stmt in MIGRATIONS[old]:
                    self._db.execute(stmt)
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    self._db.execute(stmt)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._db.execute("COMMIT")

    # ---- plumbing -------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Self:
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
        row = self._db.execute(f"SELECT {_COLUMNS} FROM {JOBS} WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise UnknownJobError(f"no job with id {job_id!r}; `sbpflow status` lists the jobs")
        return record_from_row(row)


class _Tx:
    """``with store._tx():`` holds the lock and runs the body in one BEGIN IMMEDIATE ... COMMIT."""

    def __init__(self, store: StoreDb) -> None:
        self._store = store

    def __enter__(self) -> None:
        self._store._lock.acquire()
        try:
            self._store._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            self._store._lock.release()
            raise self._failed(e) from e
        except BaseException:
            self._store._lock.release()
            raise

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            try:
                self._store._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
            except sqlite3.Error as e:
                # a COMMIT that fails (SQLITE_FULL, an I/O error) leaves the transaction open: without
                # the ROLLBACK every later write would fail "cannot start a transaction within a transaction"
                self._rollback()
                if isinstance(exc, sqlite3.Error):
                    raise self._failed(exc) from exc
                raise self._failed(e) from e
            if isinstance(exc, sqlite3.Error):
                raise self._failed(exc) from exc
            if exc_type is None:
                self._store.write_error = ""
        finally:
            self._store._lock.release()

    def _rollback(self) -> None:
        try:
            self._store._db.execute("ROLLBACK")
        except sqlite3.Error:  # none was open
            pass

    def _failed(self, e: sqlite3.Error) -> StoreUnavailable:
        self._store.write_error = f"{type(e).__name__}: {e}"
        return StoreUnavailable(
            f"the job store {self._store.path} cannot write ({self._store.write_error}); free disk space or "
            "fix the store's volume, then retry"
        )
