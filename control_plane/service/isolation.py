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
- **Fair shares** (:class:`Fairness`, per kind: unary calls, streams): a caller is its host (the peer
  without its port), its connection (the peer) and its client (the ``sbpflow-client-id`` metadata, or the
  connection without one). Each holds at most its :class:`Shares` of the calls in flight -- half per
  client, 5/8 per connection, 3/4 per host -- so that one client's flood leaves room for the others, on
  its own host and connection too; a client that rotates ids on one connection is still held to the
  connection's share. Past the host's share a caller with nothing in flight is still admitted (a
  ``newcomer`` eighth), so that a bystander on a crowded host is served. A refusal is RESOURCE_EXHAUSTED at
  once, saying what is in flight, the limit and when to retry (also in the trailing metadata
  ``retry-after-ms``, which ``client.py`` honours); never CANCELLED. A call that waited over
  ``MAX_QUEUED`` s for a handler thread is refused the same way, not run late.
- **Transport bounds** (:func:`transport_options`): what gRPC itself holds before any handler, the token
  check included, runs: metadata size, streams per connection, the backlog of calls not yet picked up
  (gRPC cancels calls past it: it is set well above what the per-connection limit lets one client
  reach), handshake time, idle connections and dead peers (keepalive).
- **Bind** (:func:`check_bind`): a server on a non-loopback address without a token would run anyone's
  jobs; it is refused unless ``insecure`` is given. A port is the server's alone (``grpc.so_reuseport``
  off: gRPC's default let a second server on the same port take half the connections), and port 0 on a
  name of several addresses (``localhost``: 127.0.0.1 and ::1) is a port free on all of them
  (``launch/ports.py``): gRPC keeps the first address's port for the others and, where another process
  holds it there, silently serves on the first alone while that process gets the other's clients.
"""

from __future__ import annotations

import collections
import ipaddress
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from sbpflow.control_plane.launch.ports import NOT_SHARED
from sbpflow.errors import SbpflowError

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})
CLIENT_ID_KEY = "sbpflow-client-id"  # gRPC metadata: which client of a host a call is from
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a refusal: when to try again (client.py reads it)
MAX_CLIENT_ID = 64  # characters of a client id kept as a key: the metadata is the caller's to choose
YIELD_TO_UNARY = 0.05  # s a stream's message waits at most for the unary calls in flight to finish
MAX_QUEUED = (
    1.0  # s a call may wait for a handler thread; past it the server is saturated: refuse, do not run late
)
UNARY_RETRY_MS, STREAM_RETRY_MS = 100, 1000  # a Get takes about a millisecond; a stream is held for long


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


@dataclass(frozen=True)
class Shares:
    """How many calls of one kind one client, one connection and one host may have in flight."""

    client: int
    connection: int  # below ``host``: a client that rotates its id on one connection is held here
    host: int
    newcomer: int  # past ``host``, for a caller with nothing in flight: a bystander on a crowded host
    retry_ms: int  # the wait a refusal suggests

    @classmethod
    def of(cls, total: int, retry_ms: int) -> Shares:
        """Shares of ``total`` calls at once: 1/2 per client, 5/8 per connection (the channels of one process
        share one, so a second client of that process has room), 3/4 per host, and 1/8 for newcomers: host +
        newcomer < total, so another host always has room."""
        client, connection, host, newcomer = (max(1, total * eighths // 8) for eighths in (4, 5, 6, 1))
        return cls(client, connection, host, newcomer, retry_ms)


@dataclass(frozen=True)
class Caller:
    host: str  # the peer without its port: "ipv4:10.0.0.7", "ipv6:[::1]"
    connection: str  # the peer: "ipv4:10.0.0.7:53412"
    client: str  # the client-id metadata (cut), or the connection

    @classmethod
    def of(cls, peer: str, metadata: Sequence[tuple[str, Any]] | None) -> Caller:
        host = peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
        given = dict(metadata or ()).get(CLIENT_ID_KEY, "")
        given = given.decode(errors="replace") if isinstance(given, bytes) else str(given)
        return cls(host, peer, f"id {given[:MAX_CLIENT_ID]!r}" if given else f"connection {peer}")


class Fairness:
    """Calls of one kind in flight per client, connection and host; past a share a call is refused."""

    def __init__(self, shares: Shares, kind: str) -> None:
        self.shares, self.kind = shares, kind
        self._lock = threading.Lock()
        self.held: collections.Counter[tuple[str, ...]] = collections.Counter()

    @staticmethod
    def _keys(c: Caller) -> tuple[tuple[str, ...], ...]:
        return ("client", c.host, c.client), ("connection", c.connection), ("host", c.host)

    def enter(self, c: Caller) -> str:
        """Count a call of ``c``: '' if admitted, else why not (nothing counted)."""
        s, held = self.shares, self.held
        client, conn, host = self._keys(c)
        with self._lock:
            newcomer = held[client] == 0 and held[conn] == 0
            # (key, its share, who it is): the first one full refuses the call
            rows = (
                (client, s.client, f"client {c.client} of {c.host}"),
                (conn, s.connection, f"connection {c.connection}"),
                (host, s.host + (s.newcomer if newcomer else 0), f"host {c.host}"),
            )
            for key, share, who in rows:
                if held[key] >= share:
                    return f"{who} has {held[key]} {self.kind} in flight, the limit is {share}"
            for key, _, _ in rows:
                held[key] += 1
        return ""

    def leave(self, c: Caller) -> None:
        with self._lock:
            for key in self._keys(c):
                self.held[key] -= 1
                if self.held[key] <= 0:
                    del self.held[key]  # the table holds only callers with calls in flight


def refuse(context: grpc.ServicerContext, message: str, retry_ms: int) -> NoReturn:
    """End the call RESOURCE_EXHAUSTED, with when to retry in the message and in the trailing metadata."""
    context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_ms)),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}; retry after {retry_ms} ms")
    raise AssertionError("unreachable: abort raises")


class CapacityInterceptor(grpc.ServerInterceptor):
    """Gates every response stream with a :class:`StreamGate`, counts unary calls, and holds each caller
    to its fair share of both (:class:`Fairness`)."""

    def __init__(self, gate: StreamGate, unary: CallCounter) -> None:
        self.gate, self.unary = gate, unary
        self.fair_unary = Fairness(Shares.of(unary.threads, UNARY_RETRY_MS), "unary calls")
        self.fair_streams = Fairness(Shares.of(gate.limit, STREAM_RETRY_MS), "streams")

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        method = details.method  # type: ignore[attr-defined]
        arrived = time.monotonic()  # here, in gRPC's polling thread; the handler runs in the pool
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method, arrived),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, method, arrived),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _admit(self, context: grpc.ServicerContext, fair: Fairness, method: str, arrived: float) -> Caller:
        """The caller, counted in ``fair``; or the call refused (the server saturated, or the caller past
        its share)."""
        waited = time.monotonic() - arrived
        if waited > MAX_QUEUED:
            why = f"the server is saturated (this call waited {waited:.1f} s for a handler thread)"
            refuse(context, f"{method}: {why}", fair.shares.retry_ms)
        caller = Caller.of(context.peer(), context.invocation_metadata())
        why = fair.enter(caller)
        if why:
            refuse(context, f"{method}: {why}, its fair share of the server", fair.shares.retry_ms)
        return caller

    def _stream(
        self, behavior: Callable[..., Iterator[Any]], method: str, arrived: float
    ) -> Callable[..., Iterator[Any]]:
        gate, unary, fair = self.gate, self.unary, self.fair_streams

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not gate.enter():
                why = f"{gate.limit} streams are open, the server's limit (--max-streams)"
                refuse(context, f"{method}: {why}; close a Watch or Logs stream", fair.shares.retry_ms)
            try:
                caller = self._admit(context, fair, method, arrived)
                try:
                    for message in behavior(request, context):
                        unary.wait_idle(YIELD_TO_UNARY)
                        yield message
                finally:
                    fair.leave(caller)
            finally:
                gate.leave()

        return stream

    def _unary(self, behavior: Callable[..., Any], method: str, arrived: float) -> Callable[..., Any]:
        unary, fair = self.unary, self.fair_unary

        def call(request: Any, context: grpc.ServicerContext) -> Any:
            if unary.exhausted:
                why = f"all {unary.threads} unary handler threads are busy"
                refuse(context, f"{method}: {why}", fair.shares.retry_ms)
            caller = self._admit(context, fair, method, arrived)
            unary.add(1)
            try:
                return behavior(request, context)
            finally:
                unary.add(-1)
                fair.leave(caller)

        return call


# gRPC's bounds on what a connection holds before any handler (the token check included) runs
MAX_METADATA_BYTES = 16 * 1024  # a call's headers: past it gRPC may refuse, past twice it always does
STREAMS_PER_CONNECTION = 4096  # HTTP/2 streams open at once on one connection; past it REFUSED_STREAM
PENDING_CALLS = 8192  # calls not yet picked up by the handler loop; gRPC cancels some past it, all past 2x
HANDSHAKE_MS = 10_000  # a connection that has not finished its handshake by then is closed
IDLE_MS = 300_000  # a connection with no call for this long is closed (clients reconnect by themselves)
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 60_000, 20_000  # ping a quiet connection; no answer: it is closed


def transport_options() -> list[tuple[str, int]]:
    """The gRPC server options that bound a connection before auth (the message size is the caller's)."""
    return [
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", 2 * MAX_METADATA_BYTES),
        ("grpc.max_concurrent_streams", STREAMS_PER_CONNECTION),
        ("grpc.server.max_pending_requests", PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_MS),
        ("grpc.max_connection_idle_ms", IDLE_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        NOT_SHARED,
    ]


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
