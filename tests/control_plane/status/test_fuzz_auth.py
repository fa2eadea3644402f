"""Hostile credentials against a real control plane with a token (issue 13), over gRPC, raw HTTP/2 and
HTTP: missing, wrong, huge, non-ASCII and control bytes, wrong schemes, repeated headers, the token's
prefix and extensions, the binary header of the same name. The contract checked:

- without the token every call is refused before any handler runs: UNAUTHENTICATED (or PERMISSION_DENIED)
  with a message — never UNKNOWN, INTERNAL or a dropped connection — and nothing is stored; only a header
  past the transport's own limits (8 KiB of metadata, some; 16 KiB, all) is refused by gRPC itself,
  RESOURCE_EXHAUSTED;
- a value no gRPC client may send (non-ASCII, NUL, control bytes) is sent as raw HTTP/2 frames and
  refused the same way;
- the HTTP endpoint answers 401 with a JSON error (431/400 for a header too large to read);
- the server stays healthy: a Get with the token answers after every example.

Example counts are fixed and the draws derandomized (tests/conftest.py). The figures are printed by the
last test (``pytest -s``), like test_fuzz.py's.
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sbpflow.codec import wire
from sbpflow.control_plane.service.server import ControlPlane
from sbpflow.control_plane.status.throttle import FailureLimit, Throttle
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.service.test_fuzz import FUZZ, SERVICE, _submit_bytes, memory_cap, serving  # noqa: F401 - a fixture
from tests.control_plane.serving import answered
from tests.examples.test_examples import load

TOKEN = "s3cret-t0ken"
RIGHT = f"Bearer {TOKEN}"
REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
# gRPC's limits on a call's metadata: past the soft one the transport refuses some calls (at random), past
# the hard one (16 KiB) every call, with RESOURCE_EXHAUSTED, before the server sees them
SOFT_LIMIT, HARD_LIMIT = 8 << 10, 16 << 10
FIGURES: Counter[str] = Counter()

# ---- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, memory_cap: None) -> Iterator[ControlPlane]:  # noqa: F811
    for p in serving(tmp_path_factory.mktemp("fuzz-auth"), auth_token=TOKEN):
        # hundreds of wrong tokens from one address here: the rate limit would answer RESOURCE_EXHAUSTED /
        # 429 after 20 (test_throttle.py checks that); this file checks each one is refused as such
        p.check.throttle = Throttle(FailureLimit(failures=1 << 30))
        yield p


@pytest.fixture(scope="module")
def channel(plane: ControlPlane) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(plane.address) as ch:
        yield ch


class Blob(bytes):
    def __repr__(self) -> str:  # a failing example prints this, not kilobytes of protobuf
        return f"<a serialised job of {len(self)} bytes>"


@pytest.fixture(scope="module")
def job_bytes() -> bytes:
    return Blob(wire.job_to_proto(load("mlp").make_job(steps=1)).SerializeToString())


@pytest.fixture(scope="module")
def known(channel: grpc.Channel, job_bytes: bytes) -> str:
    """A job submitted with the token: the calls name it, and the health probe Gets it."""
    reply = channel.unary_unary(SERVICE + "Submit")(
        _submit_bytes(job_bytes), metadata=(("authorization", RIGHT),), timeout=30
    )
    return sp.SubmitJobResponse.FromString(reply).job_id


def healthy(plane: ControlPlane, channel: grpc.Channel, known: str, jobs: int = 1) -> None:
    """A Get with the token answers, and no refused call stored a job."""
    get = channel.unary_unary(SERVICE + "Get")
    # a loaded machine's server may ask to retry (the status contract): it must answer then
    reply = answered(
        get, sp.GetJobRequest(job_id=known).SerializeToString(), 20.0, metadata=(("authorization", RIGHT),)
    )
    st_ = sp.JobStatus.FromString(reply)
    assert st_.job_id == known and plane.store.count() == jobs


# ---- gRPC, through the client library ----------------------------------------------------------

_WRONG = st.sampled_from(
    [
        "",
        "Bearer",
        "Bearer ",
        "Bearer wrong",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Bearer {TOKEN.upper()}",
        f"Basic {TOKEN}",
        f"Token {TOKEN}",
        TOKEN,
        f"Bearer{TOKEN}",
        f"Bearer {TOKEN} {TOKEN}",
        "Bearer " + "x" * 4000,
        "Bearer " + "x" * 15000,
        "Bearer " + "x" * 20000,
        "Bearer " + "x" * (1 << 20),
        "Bearer %00%ff",
        "Bearer ../../etc/passwd",
    ]
) | st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)


@st.composite
def hostile_metadata(draw: st.DrawFn) -> tuple[tuple[str, str | bytes], ...]:
    """Call metadata without the token (every draw), in one of several shapes."""
    shape = draw(st.integers(0, 4))
    wrong = draw(_WRONG)
    if shape == 0:
        return ()
    if shape == 1:
        return (("authorization", wrong),)
    if shape == 2:  # the token under another key, the binary header, or a wrong value twice
        key = draw(st.sampled_from(["x-authorization", "token", "authorization-bin", "auth"]))
        value: str | bytes = draw(st.binary(max_size=64)) if key.endswith("-bin") else RIGHT
        return ((key, value),)
    if shape == 3:
        return (("authorization", wrong), ("authorization", draw(_WRONG)))
    pad = draw(st.integers(0, 200))  # many headers, the token absent
    return tuple((f"x-pad-{i}", "y" * 100) for i in range(pad)) + (("authorization", wrong),)


def _size(metadata: tuple[tuple[str, str | bytes], ...]) -> int:
    return sum(len(k) + len(v) + 32 for k, v in metadata)  # HTTP/2's accounting: 32 bytes an entry


_CALLS: dict[str, Any] = {
    "Submit": None,  # the fixture's job
    "Get": sp.GetJobRequest,
    "List": None,
    "Cancel": sp.CancelJobRequest,
    "GetResult": sp.GetResultRequest,
    "Resume": sp.ResumeJobRequest,
    "Watch": sp.WatchJobRequest,
    "Logs": sp.LogsRequest,
    "ListCheckpoints": sp.ListCheckpointsRequest,
    "ReadCheckpoint": sp.ReadCheckpointRequest,
}


def _body(method: str, known: str, job_bytes: bytes) -> bytes:
    """A valid request of ``method`` about the known job: all it lacks is the token."""
    if method == "Submit":
        return _submit_bytes(job_bytes)
    if method == "List":
        return sp.ListJobsRequest(page_size=10).SerializeToString()
    return bytes(_CALLS[method](job_id=known).SerializeToString())


def refused(fn: Any, size: int) -> grpc.StatusCode:
    """Run one call that must be refused; count it."""
    FIGURES["tried"] += 1
    try:
        fn()
    except grpc.RpcError as e:
        code = e.code()
        # the other headers of a call (path, authority, user agent, ...) take about 600 bytes
        expected = REFUSED | ({grpc.StatusCode.RESOURCE_EXHAUSTED} if size + 1000 > SOFT_LIMIT else set())
        # past the hard limit gRPC's own transport refuses, before the server, and says nothing
        silent = code == grpc.StatusCode.RESOURCE_EXHAUSTED and size + 1000 > HARD_LIMIT
        if code not in expected or not (e.details() or silent):
            FIGURES["crashes"] += 1
            raise AssertionError(f"unclean refusal: {code} {e.details()!r} ({size} bytes)") from None
        FIGURES[f"refused {code.name}"] += 1
        return code
    FIGURES["accepted"] += 1
    raise AssertionError(f"accepted without the token ({size} bytes of metadata)")


@FUZZ(max_examples=200)
@given(metadata=hostile_metadata(), method=st.sampled_from(sorted(_CALLS)))
def test_calls_without_the_token_are_refused_unauthenticated(
    metadata: tuple[tuple[str, str | bytes], ...],
    method: str,
    plane: ControlPlane,
    channel: grpc.Channel,
    job_bytes: bytes,
    known: str,
) -> None:
    body = _body(method, known, job_bytes)
    if method in ("Watch", "Logs", "ReadCheckpoint"):
        call: Any = lambda: list(channel.unary_stream(SERVICE + method)(body, metadata=metadata, timeout=10))  # noqa: E731
    else:
        call = lambda: channel.unary_unary(SERVICE + method)(body, metadata=metadata, timeout=10)  # noqa: E731
    refused(call, _size(metadata))
    healthy(plane, channel, known)


def test_the_open_and_the_guarded_services_without_the_token(
    plane: ControlPlane, channel: grpc.Channel, known: str
) -> None:
    from grpc_health.v1 import health_pb2

    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    assert health_pb2.HealthCheckResponse.FromString(check(b"", timeout=5)).status == 1  # open: SERVING
    reflect = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert refused(lambda: list(reflect(iter([b"\x3a\x00"]), timeout=5)), 0) in REFUSED
    healthy(plane, channel, known)


# ---- gRPC, as raw HTTP/2 frames: what no gRPC client may send ------------------------------------


def _int(n: int, bits: int, first: int = 0) -> bytes:
    """An HPACK integer with a ``bits``-bit prefix."""
    top = (1 << bits) - 1
    if n < top:
        return bytes([first | n])
    out = [first | top]
    n -= top
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    return bytes([*out, n])


def _literal(name: bytes, value: bytes) -> bytes:
    """A header as an HPACK literal without indexing, new name, no Huffman coding."""
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


_STATIC = {8: (b":status", b"200")}  # the only indexed header a trailers-only answer uses


def _headers(block: bytes) -> dict[bytes, bytes]:
    """Decode an HPACK block of literals (and ``:status 200``); anything else is a test failure, never
    read as a pass."""
    out, i = {}, 0
    while i < len(block):
        b = block[i]
        if b & 0x80:
            out.update([_STATIC[b & 0x7F]])
            i += 1
            continue
        assert b in (0x00, 0x40, 0x10), f"HPACK representation {b:#x} not handled by this decoder"
        i += 1
        fields = []
        for _ in range(2):
            assert not block[i] & 0x80, "a Huffman-coded string: not handled by this decoder"
            n, i = block[i] & 0x7F, i + 1
            fields.append(block[i : i + n])
            i += n
        out[fields[0]] = fields[1]
    return out


def raw_call(port: int, path: str, authorization: bytes, body: bytes) -> dict[bytes, bytes] | str:
    """One gRPC call as raw HTTP/2 with ``authorization`` as given; the trailers-only answer's headers,
    or the name of the frame that refused the stream (RST_STREAM, GOAWAY)."""
    headers = [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"127.0.0.1"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"authorization", authorization),
    ]  # fmt: skip
    block = b"".join(_literal(k, v) for k, v in headers)
    message = b"\x00" + struct.pack(">I", len(body)) + body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"")
        s.sendall(preface + _frame(1, 4, 1, block) + _frame(0, 1, 1, message))
        buf, deadline = b"", time.monotonic() + 10
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            assert chunk, "the server dropped the connection without an answer"
            buf += chunk
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
                payload, buf = buf[9 : 9 + n], buf[9 + n :]
                if kind == 4 and not flags & 1:
                    s.sendall(_frame(4, 1, 0, b""))  # acknowledge the server's settings
                elif kind == 1 and flags & 1:  # HEADERS ending the stream: the trailers
                    return _headers(payload)
                elif kind in (3, 7):
                    return {3: "RST_STREAM", 7: "GOAWAY"}[kind]
    raise AssertionError("no answer within 10 s")


_BYTES = st.sampled_from(
    [
        f"Bearer {TOKEN[:4]}é{TOKEN[5:]}".encode(),
        b"Bearer " + TOKEN[:-1].encode() + b"\x00",
        b"Bearer \xff\xfe\xfd",
        b"Bearer s3\x01cret",
        b"Bearer \r\n" + TOKEN[1:].encode(),
        "Bearer 名前".encode(),
        b"\x80" * 200,
        b"Bearer " + bytes(range(256)),
    ]
) | st.binary(max_size=80).map(lambda b: b"Bearer " + b)
# (bytes that hold the token itself are no hostile credential: the transport ends a value at a NUL and the
# check trims the whitespace around a token, so "Bearer <token>\x00" is the token, sent oddly)


@FUZZ(max_examples=60)
@given(authorization=_BYTES, method=st.sampled_from(["Submit", "Get", "List", "Cancel"]))
def test_bytes_no_grpc_client_may_send_are_refused_unauthenticated(
    authorization: bytes,
    method: str,
    plane: ControlPlane,
    channel: grpc.Channel,
    job_bytes: bytes,
    known: str,
) -> None:
    assume(TOKEN.encode() not in authorization)
    FIGURES["tried"] += 1
    got = raw_call(plane.port, SERVICE + method, authorization, _body(method, known, job_bytes))
    if isinstance(got, str):  # the transport refused the header itself: the stream never reached a handler
        FIGURES[f"refused {got}"] += 1
    else:
        code = int(got.get(b"grpc-status", b"-1"))
        message = urllib.parse.unquote(got.get(b"grpc-message", b"").decode())
        if code != grpc.StatusCode.UNAUTHENTICATED.value[0] or not message:
            FIGURES["crashes"] += 1
            raise AssertionError(f"{authorization[:40]!r}: grpc-status {code} {message!r}")
        assert TOKEN not in message  # the refusal never echoes a credential
        FIGURES["refused UNAUTHENTICATED"] += 1
    healthy(plane, channel, known)


def test_the_raw_client_is_a_real_grpc_client(plane: ControlPlane, known: str) -> None:
    """With the right token the same frames reach the handler (so a refusal above is the token's)."""
    got = raw_call(
        plane.port, SERVICE + "Get", RIGHT.encode(), sp.GetJobRequest(job_id="nope").SerializeToString()
    )
    assert isinstance(got, dict) and got[b"grpc-status"] == b"5", got  # NOT_FOUND: past the auth check


# ---- HTTP ------------------------------------------------------------------------------------------

_HTTP_AUTH = st.sampled_from(
    [
        None,
        b"",
        b"Bearer wrong",
        b"Basic " + TOKEN.encode(),
        TOKEN.encode(),
        f"Bearer {TOKEN[:4]}é".encode(),
        b"Bearer \xff\xfe",
        b"Bearer " + b"x" * 70000,
        b"Bearer " + TOKEN[:-1].encode() + b"\x00",
    ]
) | st.binary(max_size=60).filter(lambda b: b"\r" not in b and b"\n" not in b)


def http_raw(port: int, path: str, authorization: bytes | None) -> tuple[int, bytes]:
    head = b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if authorization is not None:
        head += b"Authorization: " + authorization + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + b"\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/"), reply[:200]
    return int(status.split()[1]), body


@FUZZ(max_examples=60)
@given(authorization=_HTTP_AUTH, path=st.sampled_from(["/v1/jobs", "/metrics", "/v1/jobs/{known}"]))
def test_http_without_the_token_answers_401_with_a_json_error(
    authorization: bytes | None, path: str, plane: ControlPlane, channel: grpc.Channel, known: str
) -> None:
    FIGURES["tried"] += 1
    assert plane.http_port is not None
    code, body = http_raw(plane.http_port, path.format(known=known), authorization)
    large = authorization is not None and len(authorization) > 60000
    # a control byte is no valid header value (RFC 9110 5.5): h11 answers 400 unread to some (NUL, VT, FF)
    control = authorization is not None and any(b < 0x20 and b != 0x09 or b == 0x7F for b in authorization)
    wanted = {401, 431, 400} if large else {400, 401} if control else {401}
    if code not in wanted or "error" not in json.loads(body):
        FIGURES["crashes"] += 1
        raise AssertionError(f"{authorization!r:.60}: {code} {body[:200]!r}")
    assert TOKEN.encode() not in body
    FIGURES[f"refused HTTP {code}"] += 1
    healthy(plane, channel, known)


def test_zz_figures(plane: ControlPlane, channel: grpc.Channel, known: str) -> None:
    """The figures of the whole file (run last: pytest keeps the file's order)."""
    healthy(plane, channel, known)
    refusals = ", ".join(
        f"{n} {k.removeprefix('refused ')}" for k, n in sorted(FIGURES.items()) if "refused" in k
    )
    print(
        f"\nfuzz (token): {FIGURES['tried']} hostile credentials tried, "
        f"{sum(n for k, n in FIGURES.items() if 'refused' in k)} refused cleanly ({refusals}), "
        f"{FIGURES['accepted']} accepted, {FIGURES['crashes']} crashes; "
        f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB"
    )
    assert FIGURES["crashes"] == 0 and FIGURES["accepted"] == 0
