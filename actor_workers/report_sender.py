"""How a worker's ``WorkerReport``s reach the control plane: from a background thread, batched, so a slow
control plane never stalls a step and a thousand workers do not make a call per step each.

    reporter = Reporter(address, job_id, attempt, rank, worker_id, credential, on_cancel=worker.abort)
    reporter.send(step=progress.step_report(step, loss, seconds))
    reporter.close()                       # what is queued goes out first (bounded by a timeout)

Rules:
- a report goes out at once when no batch went for :data:`BATCH_SECONDS` (the first step of a job is
  never held back); reports that come faster wait and go together: at most one batch per
  ``BATCH_SECONDS`` per worker, and a report waits at most that long;
- ``done``, ``error`` and ``log`` reports flush the queue at once and do not count as a batch (a job's
  end is never delayed, nor its first step by the "running" line before it); so does a report sent
  with ``flush=True``: a checkpoint step's, so the control plane holds every loss up to a checkpoint
  by the time it can be complete (a restart after a lost worker then resumes the latest one);
- one report is a unary ``Report``; several are one ``ReportBatch`` (at most :data:`MAX_BATCH`);
- with nothing to say for :data:`HEARTBEAT_SECONDS`, a heartbeat;
- inside a batch's wait a report that may wait does not wake the thread (it is collected when the wait
  ends): a step report a step would otherwise cost a wake-up of this thread, and on a busy worker one
  more hand-off of the GIL and the core from the compute thread;
- a batch the control plane did not answer (UNAVAILABLE, DEADLINE_EXCEEDED: it may be restarting or
  busy) goes again with the next call, at most :data:`MAX_BATCH` reports, the newest kept (the hub
  drops a redelivered step report of a batch); another refusal drops it; the run goes on either way.
  An ack with ``cancel``, or FAILED_PRECONDITION (this attempt is no longer the current one), calls
  ``on_cancel``. ``credential`` is the one the control plane minted for this job attempt, sent as the
  bearer (never the client token).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from sbpflow.actor_workers.step_reports import heartbeat, report
from sbpflow.v1 import service_pb2 as sp

HEARTBEAT_SECONDS = 2.0
BATCH_SECONDS = 1.0  # at most one batch per this many seconds while reports come faster
MAX_BATCH = 256
CALL_SECONDS = 5.0
_URGENT = frozenset({"done", "error", "log"})  # kinds that flush at once
_FLUSH = sp.WorkerReport()  # queued after a report sent with flush=True: what is queued goes at once
_AGAIN = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})  # codes (names) on which a batch goes again
_EMPTY = object()  # nothing came in time


class Reporter:
    """Sends one worker's WorkerReports from a background thread (see the module's rules)."""

    def __init__(
        self,
        address: str,
        job_id: str,
        attempt: int,
        rank: int,
        worker_id: str,
        credential: str = "",
        on_cancel: Any = None,
        host: str = "",
        channel: Any = None,
    ) -> None:
        import grpc

        from sbpflow.v1 import service_pb2_grpc as sg

        self._ids = (job_id, attempt, rank, worker_id, host)
        self._metadata = (("authorization", f"Bearer {credential}"),) if credential else ()
        self._own = channel is None and bool(address)
        self._channel = (
            channel if channel is not None else grpc.insecure_channel(address) if address else None
        )
        self._stub = sg.WorkerServiceStub(self._channel) if self._channel is not None else None
        self._queue: deque[sp.WorkerReport | None] = deque()  # None: close
        self._wake = threading.Event()  # set by a report that must not wait for the loop's next look
        self._holding = False  # the loop is inside a batch's wait and collects what came when it ends
        self._on_cancel = on_cancel
        self._closed = False
        self._again: list[sp.WorkerReport] = []  # a batch to send again with the next call
        self.calls = 0  # calls made (a batch is one)
        self.sent = 0  # reports in them
        self._thread = threading.Thread(target=self._loop, name=f"sbpflow-reporter-r{rank}", daemon=True)
        self._thread.start()

    def send(self, flush: bool = False, **payload: Any) -> None:
        self._queue.append(report(*self._ids, **payload))
        if flush:
            self._queue.append(_FLUSH)
        if flush or not self._holding or not _URGENT.isdisjoint(payload):
            self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout``), then stop (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        self._queue.append(None)
        self._wake.set()
        self._thread.join(timeout)
        if self._channel is not None and self._own:
            self._channel.close()

    def _loop(self) -> None:
        last = 0.0  # when the last call went out that no urgent report flushed
        while True:
            first = self._next(time.monotonic() + HEARTBEAT_SECONDS, hold=False)
            if first is _EMPTY:
                first = report(*self._ids, heartbeat=heartbeat())
            batch, end, urgent = self._gather(first, last + BATCH_SECONDS)
            if batch and self._stub is not None:
                if not urgent:
                    last = time.monotonic()
                self._call(batch)
            if end:
                return

    def _next(self, until: float, hold: bool) -> Any:
        """The oldest queued message, waiting until ``until`` (monotonic) at most: :data:`_EMPTY` if
        none came. ``hold``: a report that may wait does not end the wait (see the module's rules)."""
        while True:
            if self._queue:
                return self._queue.popleft()
            wait = until - time.monotonic()
            if wait <= 0:
                return _EMPTY
            self._wake.clear()
            self._holding = hold
            if not self._queue:  # looked at after the clear: a send in between has set it again
                self._wake.wait(wait)
            self._holding = False

    def _gather(
        self, first: sp.WorkerReport | None, until: float
    ) -> tuple[list[sp.WorkerReport], bool, bool]:
        """``first`` and what else comes by ``until``, sooner on an urgent report or a flush; then
        whether the reporter is closing, and whether the batch went early (it does not count as one)."""
        batch: list[sp.WorkerReport] = []
        msg = first
        while True:
            if msg is None:
                return batch, True, False
            if msg is _FLUSH:
                return batch, False, True
            batch.append(msg)
            if msg.WhichOneof("payload") in _URGENT:
                return batch, False, True
            if len(batch) >= MAX_BATCH:
                return batch, False, False
            msg = self._next(until, hold=True)
            if msg is _EMPTY:
                return batch, False, False

    def _call(self, batch: list[sp.WorkerReport]) -> None:
        import grpc

        assert self._stub is not None
        batch, self._again = (self._again + batch)[-MAX_BATCH:], []
        try:
            if len(batch) == 1:
                ack = self._stub.Report(batch[0], timeout=CALL_SECONDS, metadata=self._metadata)
            else:
                reports = sp.WorkerReports(reports=batch)
                ack = self._stub.ReportBatch(reports, timeout=CALL_SECONDS, metadata=self._metadata)
        except grpc.RpcError as e:  # the control plane may be restarting; the run goes on
            if e.code().name in _AGAIN:
                self._again = batch
            elif e.code() == grpc.StatusCode.FAILED_PRECONDITION and self._on_cancel is not None:
                self._on_cancel(f"the control plane no longer runs this attempt: {e.details()}")
            return
        except Exception:  # noqa: BLE001 - a report that cannot be sent is dropped
            return
        self.calls += 1
        self.sent += len(batch)
        done = any(m.WhichOneof("payload") == "done" for m in batch)
        if ack.cancel and self._on_cancel is not None and not done:
            self._on_cancel("the control plane cancelled the job")
