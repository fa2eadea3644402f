"""Wrong tokens are rate-limited per peer (issue 29), over HTTP (bearer, /login) and gRPC: after the
limit the peer gets 429 / RESOURCE_EXHAUSTED with the seconds to wait, whatever it sends, while a
client at another address with the right token is served."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections.abc import Iterator

import grpc
import pytest

from sbpflow.control_plane.service.server import ControlPlane
from sbpflow.control_plane.status.throttle import DEFAULT_LIMIT, FailureLimit, Throttle, peer_host
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.serving import TOKEN, serving

SERVICE = "/sbpflow.v1.JobService/"
N = DEFAULT_LIMIT.failures


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_throttle_locks_a_peer_for_the_rest_of_its_window() -> None:
    clock = Clock()
    t = Throttle(FailureLimit(failures=3, window=60.0, peers=2), clock)
    for _ in range(3):
        assert t.wait("a") == 0
        t.failed("a")
    assert t.wait("a") == 60.0 and t.wait("b") == 0  # locked; another peer is not
    clock.now += 59.5
    assert t.wait("a") == 0.5
    clock.now += 1
    assert t.wait("a") == 0  # the window passed: a fresh count
    t.failed("a")
    assert t.wait("a") == 0
    for peer in ("b", "c", "d"):  # the table keeps the two most recent peers: "a" is forgotten
        t.failed(peer)
    assert len(t._peers) == 2


@pytest.mark.parametrize(
    ("peer", "host"),
    [("ipv4:127.0.0.1:5678", "127.0.0.1"), ("ipv6:[::1]:5678", "::1"), ("unix:/tmp/s", "unix:/tmp/s")],
)
def test_a_grpc_peer_is_its_address_without_the_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """Served on "localhost": gRPC listens on 127.0.0.1 and ::1, two peers one machine can be."""
    with serving(tmp_path_factory.mktemp("throttle"), [], host="localhost") as (p, _):
        yield p


@pytest.fixture()
def fresh(plane: ControlPlane) -> ControlPlane:
    plane.check.throttle = Throttle()  # no failures of an earlier test
    return plane


def http_get(port: int, path: str, token: str, source: str = "127.0.0.1") -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    conn.close()
    return out


def test_http_wrong_tokens_are_limited_per_peer(fresh: ControlPlane) -> None:
    from sbpflow.control_plane.status.http import StatusEndpoint

    ep = StatusEndpoint(fresh.manager, fresh.check, host="127.0.0.1")  # IPv4: 127.0.0.2 can be a second peer
    port = ep.start()
    try:
        for _ in range(N):
            assert http_get(port, "/v1/jobs", "guess")[0] == 401
        code, headers, body = http_get(port, "/v1/jobs", "guess")
        assert code == 429 and 1 <= int(headers["retry-after"]) <= 60 and "too many wrong tokens" in body
        assert http_get(port, "/v1/jobs", TOKEN)[0] == 429  # locked out: even the right token waits
        assert http_get(port, "/healthz", "")[0] == 200  # the probes stay open
        code, _, body = http_get(port, "/v1/jobs", TOKEN, source="127.0.0.2")  # another peer
        assert code == 200 and "jobs" in json.loads(body)
        assert http_get(port, "/v1/jobs", "guess", source="127.0.0.2")[0] == 401  # counted on its own
    finally:
        ep.stop()


def test_sign_in_guesses_are_limited_too(fresh: ControlPlane) -> None:
    from sbpflow.control_plane.status.http import StatusEndpoint

    ep = StatusEndpoint(fresh.manager, fresh.check, host="127.0.0.1")
    port = ep.start()
    try:
        form = urllib.parse.urlencode({"token": "guess", "next": "/"})
        kind = {"Content-Type": "application/x-www-form-urlencoded"}
        codes = []
        for _ in range(N + 2):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/login", form, kind)
            r = conn.getresponse()
            codes.append((r.status, r.getheader("Retry-After") is not None))
            r.read()
            conn.close()
        assert codes == [(401, False)] * N + [(429, True)] * 2
    finally:
        ep.stop()


def call(target: str, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as ch:
        try:
            ch.unary_unary(SERVICE + "List")(
                sp.ListJobsRequest().SerializeToString(),
                metadata=(("authorization", f"Bearer {token}"),),
                timeout=10,
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                trailers = dict(e.trailing_metadata() or ())
                assert 1 <= int(trailers["retry-after"]) <= 60 and "too many wrong tokens" in (
                    e.details() or ""
                )
            return e.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK


def test_grpc_wrong_tokens_are_limited_per_peer(fresh: ControlPlane) -> None:
    try:
        socket.create_connection(("::1", fresh.port), timeout=5).close()
    except OSError:
        pytest.skip("no IPv6 loopback here: cannot be a second peer")
    v4, v6 = f"127.0.0.1:{fresh.port}", f"[::1]:{fresh.port}"
    assert [call(v4, "guess") for _ in range(N)] == [grpc.StatusCode.UNAUTHENTICATED] * N
    assert call(v4, "guess") == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert call(v4, TOKEN) == grpc.StatusCode.RESOURCE_EXHAUSTED  # the right token too, from this peer
    assert call(v6, TOKEN) == grpc.StatusCode.OK  # another peer
    assert call(v6, "guess") == grpc.StatusCode.UNAUTHENTICATED
