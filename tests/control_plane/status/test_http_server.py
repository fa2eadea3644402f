"""The status endpoint's transport under hostile clients (issue 29): a slow flood holds no threads and is
cut at the deadline, a header bomb is refused with 431 without the server's memory growing, the
connection cap answers 503 at once, idle keep-alive connections close, and TLS keeps the same bounds.

Each test serves a real control plane's endpoint (``StatusEndpoint``) with :class:`Limits` shortened so
that a deadline passes in seconds."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sbpflow.control_plane.service.server import ControlPlane
from sbpflow.control_plane.status.http import MAX_FORM, StatusEndpoint
from sbpflow.control_plane.status.http_server import Limits
from tests.control_plane.serving import serving

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with serving(tmp_path_factory.mktemp("transport"), []) as (p, _):
        yield p


@contextmanager
def endpoint(plane: ControlPlane, **limits: float) -> Iterator[int]:
    """The control plane's status endpoint, a second one on its own port, with these limits."""
    ep = StatusEndpoint(plane.manager, plane.check, limits=Limits(max_body=MAX_FORM, **limits))  # type: ignore[arg-type]
    port = ep.start()
    try:
        yield port
    finally:
        ep.stop()


def timed_get(port: int, path: str, token: str = "") -> tuple[int, float]:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
    code = conn.getresponse().status
    conn.close()
    return code, time.monotonic() - start


def reply_of(s: socket.socket, timeout: float = 10.0) -> bytes:
    """All the server sends until it closes (or the timeout: then what came)."""
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def test_a_slow_flood_holds_no_threads_and_is_cut_at_the_deadline(plane: ControlPlane) -> None:
    with endpoint(plane, head_seconds=4.0) as port:
        assert timed_get(port, "/v1/jobs", "tok")[0] == 200
        before = threading.active_count()
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
        start = time.monotonic()
        for s in socks:
            s.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        for _ in range(3):  # a byte a second on each
            for s in socks:
                s.sendall(b"X")
            assert threading.active_count() <= before + Limits.workers, threading.active_count()
            for path, token in (("/healthz", ""), ("/v1/jobs", "tok")):
                code, took = timed_get(port, path, token)
                assert code == 200 and took < 2.0, (path, code, took)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - start) % 1.0))
        replies = [reply_of(s) for s in socks]
        cut = time.monotonic() - start
        assert all(r.startswith(b"HTTP/1.1 408 ") for r in replies), {r[:40] for r in replies}
        assert cut < 4.0 + 3.0, cut  # closed at the deadline, not whenever the client stops
        for s in socks:
            s.close()


def test_a_head_past_the_bound_or_with_too_many_fields_is_refused_431(plane: ControlPlane) -> None:
    with endpoint(plane) as port:
        for head in (
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
            + b"X-Pad: "
            + b"a" * 100
            + b"\r\n" * 1
            + b"X-Pad: a\r\n" * 2000,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%d: a\r\n" % i for i in range(200))
            + b"\r\n",
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(head)
                reply = reply_of(s)
            assert reply.startswith(b"HTTP/1.1 431 ") and b'"error"' in reply, reply[:200]
        assert timed_get(port, "/healthz")[0] == 200


def test_a_body_past_the_cap_is_refused_before_it_is_sent(plane: ControlPlane) -> None:
    with endpoint(plane) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
        assert reply_of(s).startswith(b"HTTP/1.1 413 ")


def test_connections_past_the_cap_are_answered_503_at_once(plane: ControlPlane) -> None:
    with endpoint(plane, max_connections=4) as port:
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        time.sleep(0.3)  # the server has accepted them
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            reply = reply_of(extra)
        assert reply.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in reply
        assert time.monotonic() - start < 1.0
        for s in held:
            s.close()
        deadline = time.monotonic() + 5
        while timed_get(port, "/healthz")[0] != 200:  # the slots come back once the server sees the closes
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_an_idle_keep_alive_connection_is_closed(plane: ControlPlane) -> None:
    with endpoint(plane, idle_seconds=1.0) as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"ok\n")
        start = time.monotonic()
        assert reply_of(s, timeout=5) == b""  # closed, with no reply
        assert 0.8 < time.monotonic() - start < 3.0


def test_keep_alive_serves_several_requests_on_one_connection(plane: ControlPlane) -> None:
    with endpoint(plane) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for path in ("/healthz", "/readyz", "/healthz"):
            conn.request("GET", path)
            r = conn.getresponse()
            assert r.status == 200 and r.read()
        conn.request("HEAD", "/healthz")
        r = conn.getresponse()
        assert r.status == 405 and r.getheader("Allow") == "GET, POST" and r.read() == b""
        conn.close()


def test_tls_keeps_the_bounds(plane: ControlPlane, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],  # fmt: skip
        check=True,
        capture_output=True,
    )
    ep = StatusEndpoint(
        plane.manager, plane.check, tls_cert=str(cert), tls_key=str(key), limits=Limits(head_seconds=2.0)
    )
    port = ep.start()
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
        conn.request("GET", "/v1/jobs", headers={"Authorization": "Bearer tok"})
        assert conn.getresponse().status == 200
        conn.close()
        with socket.create_connection(("127.0.0.1", port)) as s:  # never starts the handshake
            start = time.monotonic()
            assert reply_of(s) == b"" and time.monotonic() - start < 5.0
    finally:
        ep.stop()


BOMB_SERVER = """
import resource, sys, tempfile, pathlib
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
mapped = int(pathlib.Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
from tests.control_plane.serving import serving
resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 30), hard))  # the old server went past 3 GB
with serving(pathlib.Path(tempfile.mkdtemp()), []) as (plane, _):
    print(plane.http_port, flush=True)
    sys.stdin.read()
"""


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def test_a_header_bomb_is_refused_and_memory_stays_flat() -> None:
    """100 connections each sending up to 6 MB of header lines (each line short), with no token."""
    child = subprocess.Popen(
        [sys.executable, "-c", BOMB_SERVER],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert timed_get(port, "/healthz")[0] == 200
        before = rss_kib(child.pid)
        line = b"X-Pad: " + b"a" * 90 + b"\r\n"
        chunk = line * 600  # ~60 KB a send
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(100)]
        sent = [0] * len(socks)
        for s in socks:
            s.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n")
        open_ = set(range(len(socks)))
        while open_:
            for i in list(open_):
                try:
                    socks[i].sendall(chunk)
                    sent[i] += len(chunk)
                except OSError:  # the server refused and closed
                    open_.discard(i)
                if sent[i] >= 6_000_000:
                    open_.discard(i)
        grew = rss_kib(child.pid) - before
        refused = sum(reply_of(s, 3).startswith(b"HTTP/1.1 431 ") for s in socks)
        for s in socks:
            s.close()
        print(f"\nheader bomb: {len(socks)} connections, {refused} answered 431, at most {max(sent):,} B sent "
              f"on one before the cut (the kernel's buffers take most), server RSS grew {grew} KiB")  # fmt: skip
        assert child.poll() is None, "the server died"
        assert timed_get(port, "/healthz")[0] == 200
        assert refused >= 90, refused  # the rest may see the reset of a close with bytes unread
        assert grew < 64 << 10, f"RSS grew {grew} KiB"
    finally:
        child.send_signal(signal.SIGTERM)
        child.communicate(timeout=30)
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("raw", "code"),
    [(b"GET / HTTP/9.9\r\n\r\n", 505), (b"GARBAGE\r\n\r\n", 400), (b"GET /\x00 HTTP/1.1\r\n\r\n", 400)],
)
def test_a_request_h11_cannot_serve_gets_a_json_error(plane: ControlPlane, raw: bytes, code: int) -> None:
    with endpoint(plane) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        reply = reply_of(s)
    assert reply.startswith(b"HTTP/1.1 %d " % code) and b'"error"' in reply, reply[:200]
