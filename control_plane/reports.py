"""WorkerService: where Ray worker actors report to the control plane, in ``WorkerReport`` protobufs.

A :class:`ReportHub` is the servicer. Whoever runs a job subscribes to its ``(job_id, attempt)`` with
:meth:`ReportHub.listen` and gets every report of that attempt; reports of other attempts, and of jobs
nobody listens to, are dropped and answered with ``cancel=True`` so that a stray worker of an old
attempt stops. :meth:`ReportHub.cancel` makes every later answer to a job's workers ``cancel=True``:
that is how a Cancel reaches workers even when the driver cannot call them.

The hub is added to the control plane's gRPC server (``hub.add_to(server)``), or serves on its own
loopback port (``hub.serve()``) for the embedded ``sf.run``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc

from sbpflow.v1 import service_pb2 as sp
from sbpflow.v1 import service_pb2_grpc as sg

Listener = Callable[[sp.WorkerReport], None]
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ReportHub(sg.WorkerServiceServicer):
    """Routes each WorkerReport to the listener of its job attempt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: dict[tuple[str, int], Listener] = {}
        self._cancelled: set[str] = set()
        self._server: grpc.Server | None = None
        self.address = ""  # host:port once serving (own server) or set by the server it is added to

    # ---- for the driver ------------------------------------------------------------------------------
    @contextmanager
    def listen(self, job_id: str, attempt: int, listener: Listener) -> Iterator[None]:
        """Deliver the reports of ``(job_id, attempt)`` to ``listener`` until the block ends."""
        key = (job_id, attempt)
        with self._lock:
            if key in self._listeners:
                raise ValueError(
                    f"job {job_id!r} attempt {attempt} already has a listener; one run per attempt"
                )
            self._listeners[key] = listener
            self._cancelled.discard(job_id)
        try:
            yield
        finally:
            with self._lock:
                self._listeners.pop(key, None)

    def cancel(self, job_id: str) -> None:
        """Answer every later report of ``job_id`` with ``cancel=True``."""
        with self._lock:
            self._cancelled.add(job_id)

    # ---- the service -----------------------------------------------------------------------------------
    def Report(self, request: sp.WorkerReport, context: Any) -> sp.ReportAck:  # noqa: N802 - gRPC's name
        return self._deliver(request)

    def ReportStream(self, request_iterator: Iterable[sp.WorkerReport], context: Any) -> sp.ReportAck:  # noqa: N802
        ack = sp.ReportAck()
        for request in request_iterator:
            ack = self._deliver(request)
            if ack.cancel:
                break
        return ack

    def _deliver(self, report: sp.WorkerReport) -> sp.ReportAck:
        with self._lock:
            listener = self._listeners.get((report.job_id, report.attempt))
            cancel = listener is None or report.job_id in self._cancelled
        if listener is not None:
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
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="sbpflow-reports"), options=options
        )
        self.add_to(server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(
                f"WorkerService could not bind {host}:{port}; pick another port or 0 for any free one"
            )
        server.start()
        self._server, self.address = server, f"{host}:{bound}"
        return self.address

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server of its own, if any."""
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
