"""WorkerService: where Ray worker actors report to the control plane, in ``WorkerReport`` protobufs.

A :class:`ReportHub` is the servicer. Workers send one report (``Report``) or several in one message
(``ReportBatch``, what :mod:`sbpflow.actor_workers.report_sender` sends when reports come faster than it
makes calls; a batch's credential is checked once per job attempt). Whoever runs a job subscribes to
one attempt with
:meth:`ReportHub.listen`, naming the attempt's ranks, and gets back the attempt's **credential**: an
HMAC of the job id and attempt under a secret the hub draws at start and keeps in memory. The driver
hands it to that attempt's workers (never the client token), and they send it as
``authorization: Bearer <credential>``. A report is delivered only when

- it carries its job's and attempt's credential (else PERMISSION_DENIED; the bearer-token interceptor
  lets WorkerService through to this check, see ``auth.py``);
- its attempt is the one being listened to (else FAILED_PRECONDITION, on which a worker stops: a stray
  worker of an old attempt, or of a job that has ended);
- its rank is one of the attempt's ranks, and a step report's step goes forward for its rank (else
  INVALID_ARGUMENT; in a batch, such a report is one sent again after an unanswered call, and is
  skipped).

:meth:`ReportHub.cancel` makes every later answer to a job's workers ``cancel=True``: that is how a
Cancel reaches workers even when the driver cannot call them.

The hub serves on a gRPC server of its own (``hub.serve(host, port)``): the control plane's beside its
JobService port (``ServerConfig.worker_port``), the embedded ``sf.run``'s on loopback. A 1,024-rank job makes
~1,000 report calls a second, and a gRPC server handles every call's events on one thread: on the JobService's
server, a Get waited behind each second's burst of reports (p99 60-75 ms against 20-25 ms apart,
``bench/control_plane/control_plane_scale.py``). ``hub.add_to(server)`` still adds it to another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from sbpflow.control_plane.launch.ports import NOT_SHARED, free_port
from sbpflow.v1 import service_pb2 as sp
from sbpflow.v1 import service_pb2_grpc as sg

Listener = Callable[[sp.WorkerReport], None]
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
YIELD_EVERY = 16  # reports of a batch delivered between two offers of the GIL to other threads
INGESTING = 2  # report calls delivering at once (a 1,024-worker job makes ~1,000 calls a second)


class ReportRefused(Exception):
    """A report the hub does not deliver: its gRPC code and why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Listening:
    """One attempt being listened to: who gets its reports, its ranks, each rank's last step."""

    attempt: int
    listener: Listener
    ranks: frozenset[int]
    last_step: dict[int, int] = field(default_factory=dict)


class ReportHub(sg.WorkerServiceServicer):
    """Checks each WorkerReport's credential, attempt, rank and step, and routes it to its listener."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._secret = secrets.token_bytes(32)  # in memory only: a restarted hub's workers are gone
        self._listening: dict[str, _Listening] = {}  # job id -> its current attempt
        self._cancelled: set[str] = set()
        self._server: grpc.Server | None = None
        # calls delivering at once; the others wait off the GIL, so a Get competes with few threads
        self._ingesting = threading.BoundedSemaphore(INGESTING)
        self.address = ""  # host:port once serving (own server) or set by the server it is added to
        self.port = 0  # the port of its own server, once serving

    # ---- for the driver ------------------------------------------------------------------------------
    def credential(self, job_id: str, attempt: int) -> str:
        """The credential of ``(job_id, attempt)``'s workers."""
        msg = f"{len(job_id)}:{job_id}:{attempt}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    @contextmanager
    def listen(self, job_id: str, attempt: int, listener: Listener, ranks: Iterable[int]) -> Iterator[str]:
        """Deliver the reports of ``(job_id, attempt)`` from ``ranks`` to ``listener`` until the block
        ends; the block gets the credential to give the attempt's workers."""
        with self._lock:
            if job_id in self._listening:
                held = self._listening[job_id].attempt
                raise ValueError(
                    f"job {job_id!r} attempt {held} already has a listener; one attempt of a job at a time"
                )
            self._listening[job_id] = _Listening(attempt, listener, frozenset(ranks))
            self._cancelled.discard(job_id)
        try:
            yield self.credential(job_id, attempt)
        finally:
            with self._lock:
                self._listening.pop(job_id, None)

    def cancel(self, job_id: str) -> None:
        """Answer every later report of ``job_id`` with ``cancel=True``."""
        with self._lock:
            self._cancelled.add(job_id)

    # ---- the service -----------------------------------------------------------------------------------
    def Report(self, request: sp.WorkerReport, context: Any) -> sp.ReportAck:  # noqa: N802 - gRPC's name
        try:
            with self._ingesting:
                return self._deliver(request, _bearer(context))
        except ReportRefused as e:
            context.abort(e.code, str(e))
            raise  # unreachable: abort raises

    def ReportStream(self, request_iterator: Iterable[sp.WorkerReport], context: Any) -> sp.ReportAck:  # noqa: N802
        return self._deliver_all(request_iterator, context)

    def ReportBatch(self, request: sp.WorkerReports, context: Any) -> sp.ReportAck:  # noqa: N802
        return self._deliver_all(request.reports, context)

    def _deliver_all(self, reports: Iterable[sp.WorkerReport], context: Any) -> sp.ReportAck:
        """Deliver ``reports`` in order, stopping at a cancel; the first refused one aborts the call."""
        ack = sp.ReportAck()
        given = _bearer(context)
        verified: tuple[str, int] | None = None  # a batch's credential is checked once per job attempt
        try:
            with self._ingesting:
                for i, report in enumerate(reports):
                    ack = self._deliver(report, given, verified, batch=True)
                    verified = (report.job_id, int(report.attempt))
                    if ack.cancel:
                        break
                    if i % YIELD_EVERY == YIELD_EVERY - 1:
                        time.sleep(0)  # a waiting Get gets the GIL now, not at the end of a long batch
        except ReportRefused as e:
            context.abort(e.code, str(e))
        return ack

    def _deliver(
        self,
        report: sp.WorkerReport,
        given: str,
        verified: tuple[str, int] | None = None,
        batch: bool = False,
    ) -> sp.ReportAck:
        job, attempt, rank = report.job_id, int(report.attempt), int(report.rank)
        who = f"WorkerReport of job {job[:64]!r} attempt {attempt} rank {rank}"
        if (job, attempt) != verified and not hmac.compare_digest(
            given.encode(), self.credential(job, attempt).encode()
        ):
            raise ReportRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{who}: {'no' if not given else 'a wrong'} worker credential; only the workers the control "
                "plane started for that attempt may report (they carry its credential, not the client token)",
            )
        with self._lock:
            cur = self._listening.get(job)
            if cur is None or cur.attempt != attempt:
                now = "no attempt is running" if cur is None else f"the current attempt is {cur.attempt}"
                raise ReportRefused(
                    grpc.StatusCode.FAILED_PRECONDITION, f"{who}: {now}; this worker should stop"
                )
            if rank not in cur.ranks:
                raise ReportRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{who}: rank {rank} is not one of the job's ranks {sorted(cur.ranks)}",
                )
            if report.WhichOneof("payload") == "step":
                last = cur.last_step.get(rank, 0)
                if report.step.step <= last and batch:
                    return sp.ReportAck(cancel=job in self._cancelled)  # a batch sent again: seen already
                if report.step.step <= last:
                    raise ReportRefused(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{who}: step {report.step.step} does not go forward (the rank reported step {last})",
                    )
                cur.last_step[rank] = int(report.step.step)
            listener, cancel = cur.listener, job in self._cancelled
        listener(report)
        return sp.ReportAck(cancel=cancel)

    # ---- serving -------------------------------------------------------------------------------------
    def add_to(self, server: grpc.Server) -> None:
        """Serve WorkerService on ``server`` (the control plane's); set ``address`` to where it listens."""
        sg.add_WorkerServiceServicer_to_server(self, server)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on a server of its own at ``host:port`` (0 = any free port); returns ``host:port``."""
        if self._server is not None:
            return self.address
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), NOT_SHARED]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="sbpflow-reports"), options=options
        )
        self.add_to(server)
        try:
            bound = server.add_insecure_port(f"{host}:{free_port(host, port)}")
        except RuntimeError:  # grpc's "Failed to bind": the port is in use
            bound = 0
        if bound == 0:
            raise OSError(
                f"WorkerService could not bind {host}:{port}; pick another port or 0 for any free one"
            )
        server.start()
        self._server, self.address, self.port = server, f"{host}:{bound}", bound
        return self.address

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server of its own, if any."""
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None


def _bearer(context: Any) -> str:
    """The bearer credential of a call's metadata ('' without one)."""
    value = dict(context.invocation_metadata() or ()).get("authorization", "")
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    scheme, _, given = str(value).partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""
