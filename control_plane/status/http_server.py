"""The status endpoint's transport: HTTP/1.1 on one asyncio event loop with ``h11``, no thread per socket.

``http.py`` has the routes; this module only turns bytes into a :class:`Incoming` and a reply back into
bytes, under :class:`Limits` that a hostile client cannot stretch:

- a request's head and body must arrive within ``head_seconds`` of its first byte (the first request of a
  connection: of the accept), else 408 and the connection closes — a slow client holds a socket and a
  few KiB, never a thread, and not for long;
- the head is at most ``max_head`` bytes (h11 refuses to buffer more: 431) and ``max_headers`` fields;
  a form body at most ``max_body`` bytes (413, before reading it);
- at most ``max_connections`` open at once: one more is answered 503 at once and closed (never queued);
- a kept-alive connection that starts no request within ``idle_seconds`` is closed;
- with an ``ssl.SSLContext`` the handshake too must finish within ``head_seconds``.

The handler (``StatusEndpoint.serve``) reads SQLite, which blocks, so it runs in a small thread pool
(``workers`` threads), never on the loop. Threads in all: the loop's and the pool's, whatever the load.

Why h11 rather than aiohttp, uvicorn or hypercorn: it is only the HTTP/1.1 state machine (no framework,
no dependencies), and every bound above is ours to set — uvicorn and aiohttp have no deadline for a
request's head (the slow-header attack stays open), hypercorn brings an ASGI stack we do not need.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import h11

READ = 65536  # bytes a read asks for: h11 checks its buffer against max_head after each
LINGER_SECONDS, LINGER_BYTES = 1.0, 1 << 20  # after a refusal: what is read and dropped, at most


@dataclass(frozen=True)
class Limits:
    head_seconds: float = 10.0  # to receive a request's head and body
    idle_seconds: float = 30.0  # keep-alive: to start the next request
    write_seconds: float = 30.0  # to take a reply (a client that never reads is dropped)
    max_head: int = 16 * 1024  # bytes of request line and headers
    max_headers: int = 100
    max_body: int = 8192  # the only bodies are the sign-in and sign-out forms
    max_connections: int = 1024
    workers: int = 4  # threads answering requests (SQLite reads)


@dataclass(frozen=True)
class Incoming:
    method: str
    target: str  # the request target as sent: path and query
    headers: Mapping[str, str]  # lower-case names; the first of a repeated field
    body: bytes
    peer: str  # the client's address (no port)


@dataclass(frozen=True)
class Outgoing:
    code: int
    headers: tuple[tuple[str, str], ...]  # Content-Length is added here
    body: bytes


Handler = Callable[[Incoming], Outgoing]


class Refused(Exception):
    """A request the transport answers itself (``code``) and then closes the connection."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def error(code: int, message: str, *headers: tuple[str, str]) -> Outgoing:
    body = json.dumps({"error": message}, indent=1).encode()
    return Outgoing(code, (("Content-Type", "application/json"), *headers), body)


_BUSY = error(
    503, "the status endpoint has too many open connections; try again in a moment", ("Retry-After", "1")
)


class Server:
    """``start()`` binds and serves on a thread of its own, returning the port; ``stop()`` ends it."""

    def __init__(
        self, handle: Handler, host: str, port: int, tls: ssl.SSLContext | None, limits: Limits = Limits()
    ) -> None:
        self.handle, self.tls, self.limits = handle, tls, limits
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self._sock = socket.create_server(address[:2], family=family, backlog=limits.max_connections)
        self._sock.setblocking(False)
        self._loop = asyncio.new_event_loop()
        self._pool = concurrent.futures.ThreadPoolExecutor(limits.workers, thread_name_prefix="sbpflow-http")
        self._thread = threading.Thread(target=self._loop.run_forever, name="sbpflow-http-loop", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.open = 0  # connections now open (read on the loop only)

    def start(self) -> int:
        self._thread.start()
        serving = asyncio.start_server(
            self._connection,
            sock=self._sock,
            ssl=self.tls,
            ssl_handshake_timeout=self.limits.head_seconds if self.tls else None,
            limit=self.limits.max_head,
        )
        self._server = asyncio.run_coroutine_threadsafe(serving, self._loop).result()
        return int(self._sock.getsockname()[1])

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._loop.is_running():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sock.close()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.open += 1
        try:
            if self.open > self.limits.max_connections:  # refuse at once: a queue would be the attack's
                writer.write(_bare(_BUSY))
                async with asyncio.timeout(1.0):
                    await writer.drain()
                return
            await self._requests(reader, writer)
        except (ConnectionError, TimeoutError, ssl.SSLError, h11.ProtocolError):
            pass  # the client went away, too slowly, or spoke nonsense after its answer: just close
        except asyncio.CancelledError:
            pass  # stop(): the connection ends with the server (asyncio logs a cancelled handler task)
        finally:
            self.open -= 1
            self._tasks.discard(task)
            writer.close()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head)
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else ""
        first = True
        while True:
            try:
                got = await self._receive(conn, reader, writer, first)
            except Refused as r:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await self._send(conn, writer, error(r.code, str(r), ("Connection", "close")), False)
                    await _linger(reader, writer)
                return
            if got is None:
                return
            req, body = got
            incoming = Incoming(req.method.decode(), req.target.decode("latin-1"), _fields(req), body, host)
            out = await self._loop.run_in_executor(self._pool, self.handle, incoming)
            await self._send(conn, writer, out, req.method == b"HEAD")
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return  # Connection: close, HTTP/1.0, or a body we did not read
            conn.start_next_cycle()
            first = False

    async def _receive(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool
    ) -> tuple[h11.Request, bytes] | None:
        """The next request and its body; None when the client closed or went idle between requests."""
        lim = self.limits
        started = first or bool(conn.trailing_data[0])
        now = self._loop.time()
        deadline = asyncio.timeout_at(now + (lim.head_seconds if started else lim.idle_seconds))
        req: h11.Request | None = None
        body = bytearray()
        try:
            async with deadline:
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await reader.read(READ)
                        if not started and data:  # the next request began: its head has head_seconds
                            started = True
                            deadline.reschedule(self._loop.time() + lim.head_seconds)
                        conn.receive_data(data)
                    elif isinstance(event, h11.Request):
                        req = _check_head(event, lim)
                        if conn.they_are_waiting_for_100_continue:
                            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                    elif isinstance(event, h11.Data):
                        body += event.data
                        if len(body) > lim.max_body:
                            raise Refused(413, f"a body of at most {lim.max_body} bytes")
                    elif isinstance(event, h11.EndOfMessage):
                        assert req is not None
                        return req, bytes(body)
                    else:  # ConnectionClosed, or PAUSED after a close we asked for
                        return None
        except TimeoutError:
            if not started:
                return None  # an idle keep-alive connection: close it quietly
            raise Refused(408, f"the request did not arrive within {lim.head_seconds:g} s") from None
        except h11.RemoteProtocolError as e:
            code = e.error_status_hint
            what = (
                f"the request head is over {lim.max_head} bytes" if code == 431 else f"malformed request: {e}"
            )
            raise Refused(code, what) from None

    async def _send(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, out: Outgoing, head: bool
    ) -> None:
        headers = [*out.headers, ("Content-Length", str(len(out.body)))]
        data = conn.send(h11.Response(status_code=out.code, headers=headers))
        if not head:  # a HEAD reply has the length of the body it does not send
            data += conn.send(h11.Data(data=out.body))
        data += conn.send(h11.EndOfMessage())
        writer.write(data)
        async with asyncio.timeout(self.limits.write_seconds):
            await writer.drain()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read and drop what the client is still sending, for a moment, before closing: a socket closed with
    unread bytes sends a reset, which can destroy the refusal before the client reads it."""
    if writer.can_write_eof():
        writer.write_eof()
    dropped = 0
    try:
        async with asyncio.timeout(LINGER_SECONDS):
            while dropped < LINGER_BYTES and (data := await reader.read(READ)):
                dropped += len(data)
    except TimeoutError:
        pass


def _check_head(req: h11.Request, lim: Limits) -> h11.Request:
    if req.http_version not in (b"1.0", b"1.1"):  # h11 parses any digit.digit
        raise Refused(505, f"HTTP/{req.http_version.decode()} is not served; speak HTTP/1.1")
    if len(req.headers) > lim.max_headers:
        raise Refused(431, f"{len(req.headers)} header fields: at most {lim.max_headers}")
    size = dict(req.headers).get(b"content-length", b"0")
    if int(size) > lim.max_body:  # h11 has checked it is a number
        raise Refused(413, f"a body of at most {lim.max_body} bytes, with its Content-Length")
    return req


def _fields(req: h11.Request) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in req.headers:
        out.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return out


def _bare(out: Outgoing) -> bytes:
    """A whole reply without h11 (the busy refusal, before any request is read)."""
    head = [f"HTTP/1.1 {out.code} Busy", *(f"{k}: {v}" for k, v in out.headers)]
    head += [f"Content-Length: {len(out.body)}", "Connection: close", "", ""]
    return "\r\n".join(head).encode() + out.body
