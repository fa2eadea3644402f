"""What keeps one kind of call from starving another, and the server from serving open by mistake.

- **Streams** (Watch, Logs, health Watch) hold a handler thread each for as long as they are open. A
  :class:`StreamGate` admits at most ``max_streams`` of them and answers the next with
  RESOURCE_EXHAUSTED; the server's thread pool has ``threads`` threads beyond that limit, so unary
  calls (Get, List, Submit, worker reports, ...) always have those to themselves.
- **Capacity** (:class:`CallCounter`) counts unary calls in flight, so that ``/readyz`` answers 503
  when every unary thread is busy (and when the store cannot write, see ``http.py``).
- **Priority**: a stream's next message waits (at most ``YIELD_TO_UNARY`` s) while unary calls are in
  flight, so hundreds of busy streams do not hold the GIL from a Get; a stream message is progress a
  client reads when it comes, a Get is a caller blocked on its answer.
- **Bind** (:func:`check_bind`): a server on a non-loopback address without a token would run anyone's
  jobs; it is refused unless ``insecure`` is given.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from sbpflow.errors import SbpflowError

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})
YIELD_TO_UNARY = 0.05  # s a stream's message waits at most for the unary calls in flight to finish


class InsecureBind(SbpflowError):
    """A non-loopback bind without a token, and no ``--insecure``."""


def is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def check_bind(host: str, token: str | None, insecure: bool) -> None:
    if token or insecure or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to serve on {host!r} without a token: anyone who reaches it could run jobs and read "
        "their results; give --auth-token (or SBPFLOW_TOKEN), bind --host 127.0.0.1, or pass --insecure "
        "if every client of that network is trusted"
    )


class StreamGate:
    """At most ``limit`` open streams."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise SbpflowError(f"max_streams={limit}: allow at least 1 stream (Watch, Logs)")
        self.limit = limit
        self._lock = threading.Lock()
        self._closed = threading.Condition(self._lock)
        self.open = 0

    def enter(self) -> bool:
        with self._lock:
            if self.open >= self.limit:
                return False
            self.open += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.open -= 1
            if self.open == 0:
                self._closed.notify_all()

    def wait_closed(self, timeout: float) -> bool:
        """Until every stream has ended (its handler returned), or ``timeout`` s; True if they all did."""
        with self._lock:
            return self._closed.wait_for(lambda: self.open == 0, timeout)


class CallCounter:
    """Unary calls in flight, of ``threads`` that can run at once."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.busy = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.busy += n
            if self.busy == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> None:
        """Until no unary call is in flight, or ``timeout`` s."""
        with self._lock:
            self._idle.wait_for(lambda: self.busy == 0, timeout)

    @property
    def exhausted(self) -> bool:
        return self.busy >= self.threads


class CapacityInterceptor(grpc.ServerInterceptor):
    """Gates every response stream with a :class:`StreamGate` and counts unary calls."""

    def __init__(self, gate: StreamGate, unary: CallCounter) -> None:
        self.gate, self.unary = gate, unary

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        method = details.method  # type: ignore[attr-defined]
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _stream(self, behavior: Callable[..., Iterator[Any]], method: str) -> Callable[..., Iterator[Any]]:
        gate, unary = self.gate, self.unary

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not gate.enter():
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method}: {gate.limit} streams are open, the server's limit (--max-streams); close a "
                    "Watch or Logs stream, or retry later (Get answers at once)",
                )
            try:
                for message in behavior(request, context):
                    unary.wait_idle(YIELD_TO_UNARY)
                    yield message
            finally:
                gate.leave()

        return stream

    def _unary(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        unary = self.unary

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            unary.add(1)
            try:
                return behavior(request, context)
            finally:
                unary.add(-1)

        return call


MIN_FREE_BYTES = 1 << 20  # below this much free space the store's disk counts as full


def store_problem(store: Any) -> str:
    """Why ``store`` cannot write now ('' when it can): its last write failed, or its disk is full or
    read-only."""
    import os

    if getattr(store, "write_error", ""):
        return f"the job store cannot write: {store.write_error}"
    path = str(getattr(store, "path", ":memory:"))
    if path == ":memory:":
        return ""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
    except OSError as e:
        return f"the job store's folder {folder} cannot be read: {type(e).__name__}"
    if free < MIN_FREE_BYTES:
        return f"the job store's disk is full ({free} bytes free in {folder})"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return f"the job store {path} is read-only"
    return ""


def unready(store: Any, unary: CallCounter) -> str:
    """/readyz's reason to answer 503 ('' when ready): the store cannot write, or no unary thread is free."""
    problem = store_problem(store)
    if problem:
        return problem
    if unary.exhausted:
        return f"all {unary.threads} unary handler threads are busy; retry shortly"
    return ""
