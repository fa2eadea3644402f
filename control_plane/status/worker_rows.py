"""Get's worker rows of a large job, built at most every :data:`ROWS_SECONDS` while it runs.

A 1,024-rank job's status holds 1,024 ``WorkerStatus`` rows; building them costs ~6 ms of Python on
every Get, while reports change some row thousands of times a second. A job with at least
:data:`CACHE_FROM` rows therefore shows rows at most ``ROWS_SECONDS`` old (workers report at most once a
second each anyway, :mod:`sbpflow.actor_workers.report_sender`): they are built once, kept serialized, and
merged into each status in C. A state change rebuilds them at once; a smaller job's rows are always
built fresh.

    rows = WorkerRows(manager.workers)
    m = records.job_status(rec)            # without workers
    rows.merge_into(m, rec)               # its workers: fresh, or at most ROWS_SECONDS old
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from sbpflow.control_plane.status import records
from sbpflow.control_plane.store.schema import JobRecord, WorkerRecord
from sbpflow.v1 import service_pb2 as sp

ROWS_SECONDS = 0.2
CACHE_FROM = 256  # rows; a smaller job's rows are built on every Get
_KEPT = 64  # jobs whose rows are kept at most (the running ones; an ended job's are dropped first)


class WorkerRows:
    """Worker rows by job: ``workers(job_id)`` gives them (the manager's live rows, else the store's)."""

    def __init__(
        self, workers: Callable[[str], Sequence[WorkerRecord]], max_age: float = ROWS_SECONDS
    ) -> None:
        self._workers = workers
        self._max_age = max_age
        self._lock = threading.Lock()
        self._built: dict[str, tuple[float, str, bytes]] = {}  # job id -> (when, state, serialized rows)

    def merge_into(self, m: sp.JobStatus, rec: JobRecord) -> None:
        """Set ``m.workers`` to the rows of ``rec``'s job."""
        now = time.monotonic()
        with self._lock:
            kept = self._built.get(rec.id)
        if kept is not None and kept[1] == str(rec.state) and now - kept[0] < self._max_age:
            m.MergeFromString(kept[2])
            return
        rows = self._workers(rec.id)
        built = sp.JobStatus()
        records.add_workers(built, rows)
        m.MergeFrom(built)
        if len(rows) < CACHE_FROM:
            return
        with self._lock:
            if len(self._built) >= _KEPT:
                self._built.pop(next(iter(self._built)))
            self._built[rec.id] = (now, str(rec.state), built.SerializeToString())
