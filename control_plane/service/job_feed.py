"""What ``Watch`` streams wait on: a change notice per job, and one store read a change for all of a job's
followers.

    feed.notify(job_id)           # after every store write about the job (notify(): about any job)
    with feed.following(job_id):  # a follower, registered while it waits
        seen = feed.job_version(job_id)                   # read before the store, then wait on it
        events, ended = feed.read(job_id, seq, last, seen, max_age=1.0)
        feed.wait(job_id, seen, timeout=1.0)

Why: with one condition for every job, each step of one job woke every stream on every job, and each
re-read the store (``get`` + ``events``) under the store's lock that Get and List need too: 500 streams
cost 1,000 SQLite reads a step. Now

- a follower waits on its own job's condition, so job B's writes do not wake job A's followers (all
  conditions share one lock; ``notify()`` without a job, for a change that may concern any job, wakes
  all of them);
- a job's followers share its **tail**: its newest events (at most ``keep``) as ``JobEvent`` messages,
  read from the store once a change by whichever follower comes first, and handed to each as copies.
  N streams on one job cost one ``store.get`` + ``store.events`` per change, not N;
- a follower re-reads at most every ``min_interval`` seconds (a job stepping every millisecond
  reaches its streams in batches, each event still once and in order) and at least every ``max_age``
  seconds even without a notice;
- a follower behind the tail (a Watch replaying a job's history from the start) reads the store
  itself until it has caught up, so a replay neither waits for nor evicts the tail;
- with many live followers the sends are budgeted: each re-reads at most every
  ``followers / LIVE_SENDS`` seconds (all jobs' followers counted), and once a job has more than
  ``CONFLATE_AT`` followers, of each run of consecutive step events in one read only the newest is sent (every
  event carries the job's whole status; state changes and log lines are never skipped, and the skipped seqs
  are step events only). 500 streams on one job stepping 80 times a second had sent ~5,000 messages a second,
  holding the GIL from the unary calls (``bench/control_plane/streams.py``). A replay is never conflated: it
  sends every event of the history.

The global ``version``/``changed`` pair still grows on every notice: the ``Logs`` streams wait on it.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sbpflow.control_plane.status.records import job_events
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.v1 import service_pb2 as sp

MIN_INTERVAL = 0.1  # s between two store reads of one job's events, at most one in each
KEEP = 1024  # events a job's tail holds
LIVE_SENDS = 500.0  # reads a second all live followers together aim at (each read: a batch of sends)
CONFLATE_AT = 16  # followers of one job beyond which runs of step events go out as their newest


@dataclass
class _Tail:
    """A job's newest events: every one with ``base < seq <= top``, read at job version ``version``."""

    base: int
    before: sp.JobStatus | None  # the status of event ``base`` (None: as a replay from it starts)
    events: list[sp.JobEvent] = field(default_factory=list)
    version: int = -1  # -1: never read
    ended: bool = False  # the job's record said it had ended, read before these events
    read_at: float = float("-inf")
    followers: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # one read at a time

    @property
    def top(self) -> int:
        return self.events[-1].seq if self.events else self.base


class JobFeed:
    """Per-job change notices and per-job shared event reads over one ``JobStore``."""

    def __init__(self, store: JobStore, min_interval: float = MIN_INTERVAL, keep: int = KEEP) -> None:
        self.store = store
        self.min_interval = min_interval
        self.keep = keep
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # every notice (Logs streams)
        self.version = 0  # grows on every notice
        self._epoch = 0  # grows on notices about any job: part of every job's version
        self._counts: dict[str, int] = {}  # notices per followed job
        self._conds: dict[str, threading.Condition] = {}  # per followed job, on ``_lock``
        self._tails: dict[str, _Tail] = {}
        self._followers = 0  # of every job

    def notify(self, job_id: str | None = None) -> None:
        """Something about ``job_id`` (None: about any job) changed in the store."""
        with self._lock:
            self.version += 1
            self.changed.notify_all()
            if job_id is None:
                self._epoch += 1
                for cond in self._conds.values():
                    cond.notify_all()
            elif job_id in self._conds:  # a job nobody follows needs no count
                self._counts[job_id] += 1
                self._conds[job_id].notify_all()

    def job_version(self, job_id: str) -> int:
        """Grows on every notice about the job (while it is followed)."""
        with self._lock:
            return self._epoch + self._counts.get(job_id, 0)

    @contextmanager
    def following(self, job_id: str, after_seq: int = 0) -> Iterator[None]:
        """Register a follower of ``job_id`` for the body (the job's condition and tail live while any do)."""
        with self._lock:
            if job_id not in self._conds:
                self._conds[job_id] = threading.Condition(self._lock)
                self._counts[job_id] = 0
                self._tails[job_id] = _Tail(after_seq, None)
            self._tails[job_id].followers += 1
            self._followers += 1
        try:
            yield
        finally:
            with self._lock:
                self._tails[job_id].followers -= 1
                self._followers -= 1
                if self._tails[job_id].followers == 0:
                    del self._conds[job_id], self._counts[job_id], self._tails[job_id]

    def wait(self, job_id: str, seen: int, timeout: float) -> None:
        """Until the job's version is no longer ``seen`` or ``timeout`` s pass."""
        with self._lock:
            self._conds[job_id].wait_for(lambda: self._epoch + self._counts[job_id] != seen, timeout)

    def read(
        self, job_id: str, seq: int, last: sp.JobStatus | None, seen: int, max_age: float
    ) -> tuple[list[sp.JobEvent], bool]:
        """The job's events after ``seq`` (``last``: the status of event ``seq``, None at a replay's start)
        as of version ``seen`` or later, and whether the job had ended before the last of them. A tail
        read less than ``min_interval`` s ago is read again only once that interval is over: the
        followers that wait for it meanwhile take the one read that ends it (coalescing)."""
        tail = self._tails[job_id]
        interval = max(self.min_interval, self._followers / LIVE_SENDS)
        gap = interval - (time.monotonic() - tail.read_at)
        if tail.version < seen and gap > 0:
            time.sleep(gap)
        with tail.lock:
            if seq < tail.base or (tail.version < 0 and seq > tail.base):  # behind, or a fresh tail
                if tail.version >= 0:
                    return self._read_store(job_id, seq, last)
                tail.base, tail.before = seq, last
            if tail.version < seen or time.monotonic() - tail.read_at >= max_age or seq > tail.top:
                self._extend(job_id, tail)
            if seq > tail.top:  # cannot happen: the tail was read after this follower's own read
                return self._read_store(job_id, seq, last)
            i = bisect.bisect_right(tail.events, seq, key=lambda e: e.seq)
            shared, ended = tail.events[i:], tail.ended
            if tail.followers > CONFLATE_AT:
                shared = conflated(shared)
        return [_copy(e) for e in shared], ended

    def _extend(self, job_id: str, tail: _Tail) -> None:
        version = self.job_version(job_id)  # before the store: a later write moves it again
        before = tail.events[-1].status if tail.events else tail.before
        new, ended = self._read_store(job_id, tail.top, before)
        tail.events.extend(new)
        if len(tail.events) > self.keep:
            drop = len(tail.events) - self.keep
            tail.base, tail.before = tail.events[drop - 1].seq, tail.events[drop - 1].status
            del tail.events[:drop]
        tail.version, tail.ended, tail.read_at = version, ended, time.monotonic()

    def _read_store(self, job_id: str, seq: int, last: sp.JobStatus | None) -> tuple[list[sp.JobEvent], bool]:
        rec = self.store.get(job_id)  # before its events: if it has ended, they are all there
        return list(job_events(rec, self.store.events(job_id, seq), last)), rec.state.terminal


def conflated(events: list[sp.JobEvent]) -> list[sp.JobEvent]:
    """``events`` without the step events that another step event follows directly."""
    return [
        e
        for i, e in enumerate(events)
        if not (e.HasField("step") and i + 1 < len(events) and events[i + 1].HasField("step"))
    ]


def _copy(e: sp.JobEvent) -> sp.JobEvent:
    out = sp.JobEvent()
    out.CopyFrom(e)
    return out
