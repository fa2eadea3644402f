"""Hostile and mistaken requests against a real control plane over loopback gRPC and HTTP.

Hypothesis mutates valid Job protobufs (one field at a time to a hostile value: NaN, infinities, huge
and negative numbers, unknown enum values, long and unprintable names, dangling references, cleared or
duplicated messages; and truncated or corrupted bytes) and sends each to Submit; it also sends malformed
Get/List/Watch/Cancel/Logs/GetResult/Resume requests and HTTP requests. The contract checked:

- every refusal has a code of the status contract with a message, never UNKNOWN and never INTERNAL
  (INTERNAL is the contract's last resort for a bug: the fuzz counts it as a crash);
- an accepted job ends in a terminal state with a reason (or is cancelled when it would run long);
- the server stays healthy: a Get of a known job answers after every example;
- the HTTP endpoint answers every request with a status and, for an error, a JSON ``{"error": ...}``.

The server runs on the in-process backend under a memory cap (``RLIMIT_AS``) so that a request that
makes it allocate without bound fails the test instead of the machine. Example counts are fixed and the
draws derandomized (tests/conftest.py), so the file takes well under a minute. The figures (inputs tried,
refused, accepted, crashes) are printed by the last test (``pytest -s``).
"""

from __future__ import annotations

import json
import math
import resource
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbpflow.codec import wire
from sbpflow.control_plane.compiler.pipeline import varint
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.device import gpu_available
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.v1 import job_pb2
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.serving import answered
from tests.examples.test_examples import load

SERVICE = "/sbpflow.v1.JobService/"
CLEAN = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE,
}
TERMINAL = {sp.JOB_STATE_SUCCEEDED, sp.JOB_STATE_FAILED, sp.JOB_STATE_CANCELLED}
RUN_SECONDS = 3.0  # an accepted job still running after this is cancelled (a mutated step count)
FIGURES: Counter[str] = Counter()  # tried / refused / accepted / crashes, over the whole file
FUZZ = partial(
    settings,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def memory_cap() -> Iterator[None]:
    """Cap this process's address space at what it maps now plus 4 GiB while the module runs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    cap = mapped + (4 << 30)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def serving(folder: Path, **config: Any) -> Iterator[ControlPlane]:
    """A fuzzed server (in-process backend, an HTTP endpoint, 4 slots) with ``config`` on top."""
    cfg = ServerConfig(
        store=str(folder / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess", timeout=60.0),
        slots=4,
        http_port=0,
        **config,
    )
    p = ControlPlane(cfg).start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, memory_cap: None) -> Iterator[ControlPlane]:
    yield from serving(tmp_path_factory.mktemp("fuzz"), max_message_bytes=8 << 20)


@pytest.fixture(scope="module")
def channel(plane: ControlPlane) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(plane.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


@pytest.fixture(scope="module")
def bases(mlp: ModuleType) -> list[bytes]:
    """Valid jobs to mutate: data parallel, tensor parallel, a two-stage pipeline with micro-batches."""
    jobs = [
        mlp.make_job(steps=2),
        mlp.make_job(steps=2, tp=True, ranks=4),
        mlp.make_job(steps=2, pp=2, ranks=2, micro_batches=2),
    ]
    return Jobs(wire.job_to_proto(j).SerializeToString() for j in jobs)


class Jobs(list[bytes]):
    def __repr__(self) -> str:  # a failing example prints this, not kilobytes of protobuf
        return f"<{len(self)} serialised jobs>"


@pytest.fixture(scope="module")
def known(channel: grpc.Channel, bases: list[bytes]) -> str:
    """A job submitted before the fuzz: the health probe Gets it after every example."""
    out = sp.SubmitJobResponse.FromString(call(channel, "Submit", _submit_bytes(bases[0])))
    settle(channel, out.job_id)
    return out.job_id


def call(channel: grpc.Channel, method: str, request: bytes, timeout: float = 20.0) -> bytes:
    """One unary call; a saturated server's retry hint is waited out (a CI run once met one on a Get)."""
    return answered(channel.unary_unary(SERVICE + method), request, timeout)


def stream(channel: grpc.Channel, method: str, request: bytes, timeout: float = 5.0) -> list[bytes]:
    return list(channel.unary_stream(SERVICE + method)(request, timeout=timeout))


def _submit_bytes(job: bytes, client_id: str = "fuzz") -> bytes:
    """A SubmitJobRequest around ``job`` as raw bytes (so that the job may be any bytes at all)."""
    tail = sp.SubmitJobRequest(client_id=client_id).SerializeToString()
    return b"\x0a" + varint(len(job)) + job + tail


def refused_cleanly(fn: Callable[[], Any]) -> grpc.RpcError | None:
    """Run one call; an error must be a clean refusal with a message. Counts the figures."""
    FIGURES["tried"] += 1
    try:
        fn()
    except grpc.RpcError as e:
        if e.code() not in CLEAN or not e.details():
            FIGURES["crashes"] += 1
            raise AssertionError(f"unclean refusal: {e.code()} {e.details()!r}") from None
        FIGURES["refused"] += 1
        return e
    FIGURES["accepted"] += 1
    return None


def healthy(channel: grpc.Channel, known: str) -> None:
    st_ = sp.JobStatus.FromString(
        call(channel, "Get", sp.GetJobRequest(job_id=known).SerializeToString(), 5.0)
    )
    assert st_.job_id == known


def settle(channel: grpc.Channel, job_id: str) -> None:
    """An accepted job ends in a terminal state with a reason; one still running is cancelled."""
    get = sp.GetJobRequest(job_id=job_id).SerializeToString()
    deadline = time.monotonic() + RUN_SECONDS
    status = sp.JobStatus.FromString(call(channel, "Get", get))
    while status.state not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.05)
        status = sp.JobStatus.FromString(call(channel, "Get", get))
    if status.state not in TERMINAL:
        call(channel, "Cancel", sp.CancelJobRequest(job_id=job_id, reason="fuzz").SerializeToString())
        deadline = time.monotonic() + 30.0
        while status.state not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.05)
            status = sp.JobStatus.FromString(call(channel, "Get", get))
    assert status.state in TERMINAL, f"job {job_id} did not end: {sp.JobState.Name(status.state)}"
    if status.state != sp.JOB_STATE_SUCCEEDED:
        assert status.reason, f"job {job_id} ended {sp.JobState.Name(status.state)} without a reason"


# ---- mutations of a Job protobuf ---------------------------------------------------------------------

_INT_RANGE = {
    FieldDescriptor.CPPTYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.CPPTYPE_ENUM: (-(1 << 31), (1 << 31) - 1),
}
_HOSTILE_INTS = [-1, 0, 1, 2, 3, 7, 99, 1 << 20, (1 << 31) - 1, -(1 << 31), 1 << 40, 1 << 62, (1 << 63) - 1]
_HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, -1.0, 0.0, -0.0, 1e308, 5e-324, 1e30, 2.5, 7.0, 1e18]


def _nodes(m: Message) -> list[Message]:
    """Every message in ``m``'s tree (map entries' message values included), ``m`` first."""
    out = [m]
    for fd, value in m.ListFields():
        if fd.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE:
            continue
        if fd.message_type.GetOptions().map_entry:
            vfd = fd.message_type.fields_by_name["value"]
            if vfd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                for k in value:
                    out += _nodes(value[k])
        elif fd.is_repeated:
            for item in value:
                out += _nodes(item)
        else:
            out += _nodes(value)
    return out


def _scalar(draw: st.DrawFn, fd: FieldDescriptor, names: list[str]) -> Any:
    t = fd.cpp_type
    if t in _INT_RANGE:
        lo, hi = _INT_RANGE[t]
        v = draw(st.sampled_from(_HOSTILE_INTS) | st.integers(lo, hi))
        return min(max(v, lo), hi)
    if t in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        return draw(
            st.sampled_from(_HOSTILE_FLOATS) | st.floats(allow_nan=True, allow_infinity=True, width=64)
        )
    if t == FieldDescriptor.CPPTYPE_BOOL:
        return draw(st.booleans())
    if fd.type == FieldDescriptor.TYPE_BYTES:
        return draw(st.binary(max_size=64))
    return draw(
        st.sampled_from(
            ["", "x" * 300, "a\x00b", "line\nbreak", "/etc/passwd", "名前", "x" * 100_000, *names]
        )
        | st.text(max_size=20)
    )


@st.composite
def mutated_job(draw: st.DrawFn, bases: list[bytes]) -> bytes:
    """A valid job with one hostile change (or, in one draw in eight, truncated or corrupted bytes)."""
    blob = bases[draw(st.integers(0, len(bases) - 1))]
    how = draw(st.integers(0, 7))
    if how == 0:
        cut = draw(st.integers(0, len(blob) - 1))
        if draw(st.booleans()):
            return blob[:cut]
        return blob[:cut] + bytes([blob[cut] ^ draw(st.integers(1, 255))]) + blob[cut + 1 :]
    job = job_pb2.Job.FromString(blob)
    names = [t.name for t in job.graph.tensors] + [o.name for o in job.graph.ops]
    node = draw(st.sampled_from([n for n in _nodes(job) if n.DESCRIPTOR.fields]))  # not an empty message
    fd = draw(st.sampled_from(list(node.DESCRIPTOR.fields)))
    _mutate(draw, node, fd, names)
    return job.SerializeToString()


def _mutate(draw: st.DrawFn, node: Message, fd: FieldDescriptor, names: list[str]) -> None:
    value = getattr(node, fd.name)
    if fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
        kfd, vfd = (fd.message_type.fields_by_name[k] for k in ("key", "value"))
        key = _scalar(draw, kfd, names)
        if vfd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if value and draw(st.booleans()):
                del value[draw(st.sampled_from(sorted(value)))]
            else:
                value[key].SetInParent()
        else:
            value[key] = _scalar(draw, vfd, names)
    elif fd.is_repeated:
        action = draw(st.integers(0, 2))
        if action == 0 or not value:
            if fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                value.add()
            else:
                value.append(_scalar(draw, fd, names))
        elif action == 1:
            del value[draw(st.integers(0, len(value) - 1))]  # a dangling reference, a missing tensor
        elif fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            value.add().CopyFrom(value[draw(st.integers(0, len(value) - 1))])  # a duplicate
        else:
            value[draw(st.integers(0, len(value) - 1))] = _scalar(draw, fd, names)
    elif fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
        if node.HasField(fd.name):
            node.ClearField(fd.name)
        else:
            value.SetInParent()
    else:
        setattr(node, fd.name, _scalar(draw, fd, names))


def submit_one(channel: grpc.Channel, blob: bytes) -> None:
    reply: list[bytes] = []
    refused_cleanly(lambda: reply.append(call(channel, "Submit", _submit_bytes(blob))))
    if reply:
        settle(channel, sp.SubmitJobResponse.FromString(reply[0]).job_id)


@FUZZ(max_examples=150)  # 300 took 54 s of the suite (the 20-minute budget)
@given(data=st.data())
def test_mutated_jobs_are_refused_cleanly_or_end_with_a_reason(
    data: st.DataObject, channel: grpc.Channel, bases: list[bytes], known: str
) -> None:
    submit_one(channel, data.draw(mutated_job(bases)))
    healthy(channel, known)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda m: setattr(m.graph.ops[0], "stage", (1 << 31) - 1), id="stage 2^31-1"),
        pytest.param(lambda m: setattr(m.graph.ops[0], "stage", -1), id="stage -1"),
        pytest.param(lambda m: setattr(m, "name", "n" * (4 << 20)), id="4 MB name"),
        pytest.param(lambda m: setattr(m.optimizer.sgd, "lr", math.nan), id="NaN lr"),
        pytest.param(lambda m: setattr(m.optimizer.sgd, "momentum", math.inf), id="inf momentum"),
        pytest.param(
            lambda m: m.data.synthetic.params.__setitem__("num_samples", math.nan), id="NaN samples"
        ),
        pytest.param(lambda m: m.data.synthetic.params.__setitem__("in", 7), id="data of the wrong width"),
        pytest.param(
            lambda m: m.data.placement.CopyFrom(
                job_pb2.Placement(device_type=1, mesh_shape=[2], ranks=[0, 0])
            ),
            id="data placement [0, 0]",
        ),
        pytest.param(lambda m: m.graph.tensors[0].shape.extend([1 << 32, 1 << 32]), id="shape wraps int64"),
        pytest.param(lambda m: setattr(m.config, "steps", 1 << 62), id="2^62 steps"),
        pytest.param(lambda m: setattr(m.config, "micro_batches", (1 << 31) - 1), id="2^31 micro-batches"),
        pytest.param(
            lambda m: [
                t.placement.__setattr__("device_type", 2) for t in m.graph.tensors if t.HasField("placement")
            ],
            id="cuda on a CPU cluster",
            marks=pytest.mark.skipif(gpu_available(), reason="this machine has a GPU"),
        ),
        pytest.param(lambda m: setattr(m.config, "precision", 99), id="unknown precision"),
        pytest.param(lambda m: m.fetches.append("no such tensor"), id="dangling fetch"),
    ],
)
def test_the_reported_hostile_jobs_are_refused_with_invalid_argument(
    mutate: Callable[[job_pb2.Job], Any], channel: grpc.Channel, bases: list[bytes], known: str
) -> None:
    m = job_pb2.Job.FromString(bases[0])
    mutate(m)
    t = time.monotonic()
    e = refused_cleanly(lambda: call(channel, "Submit", _submit_bytes(m.SerializeToString())))
    assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, "accepted"
    assert time.monotonic() - t < 5.0 and len(e.details() or "") < 5000
    healthy(channel, known)


def test_a_job_too_big_for_the_workers_is_refused_naming_both_sizes(
    tmp_path: Path, mlp: ModuleType, memory_cap: None
) -> None:
    cfg = ServerConfig(
        store=str(tmp_path / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        slots=4,
        http_port=None,
        device_memory=1000,
    )
    p = ControlPlane(cfg).start()
    try:
        with grpc.insecure_channel(p.address) as ch:
            blob = wire.job_to_proto(mlp.make_job(steps=2)).SerializeToString()
            e = refused_cleanly(lambda: call(ch, "Submit", _submit_bytes(blob)))
        assert e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "per device" in (e.details() or "") and "1000 bytes" in (e.details() or "")
    finally:
        p.stop()


# ---- malformed requests to the other methods -----------------------------------------------------

_TEXT = st.sampled_from(["", "x" * 300, "a\x00b", "../../etc", "名前", "0" * 40, "9" * 31]) | st.text(
    max_size=30
)
_INT64 = st.sampled_from([-1, 0, 1 << 62, (1 << 63) - 1, -(1 << 63)]) | st.integers(-(1 << 63), (1 << 63) - 1)
_INT32 = st.sampled_from([-1, 0, 1001, (1 << 31) - 1, -(1 << 31)]) | st.integers(-(1 << 31), (1 << 31) - 1)

REQUESTS: dict[str, Any] = {
    "Get": st.builds(sp.GetJobRequest, job_id=_TEXT),
    "List": st.builds(
        sp.ListJobsRequest,
        page_size=_INT32,
        page_token=_TEXT | st.integers(0, 10**31).map(str),
        states=st.lists(_INT32 | st.sampled_from([99, 1, 3]), max_size=4),
    ),
    "Cancel": st.builds(sp.CancelJobRequest, job_id=_TEXT, reason=_TEXT),
    "GetResult": st.builds(sp.GetResultRequest, job_id=_TEXT, parameters=st.lists(_TEXT, max_size=3)),
    "Resume": st.builds(sp.ResumeJobRequest, job_id=_TEXT, client_id=_TEXT, idempotency_key=_TEXT),
    "ListCheckpoints": st.builds(sp.ListCheckpointsRequest, job_id=_TEXT),
}
STREAMS: dict[str, Any] = {
    "Watch": st.builds(sp.WatchJobRequest, job_id=_TEXT, after_seq=_INT64),
    "Logs": st.builds(sp.LogsRequest, job_id=_TEXT, rank=_INT64),
    "ReadCheckpoint": st.builds(sp.ReadCheckpointRequest, job_id=_TEXT, step=_INT64),
}


@FUZZ(max_examples=150)
@given(
    method=st.sampled_from(sorted(REQUESTS) + sorted(STREAMS)),
    data=st.data(),
    garbage=st.none() | st.binary(min_size=1, max_size=40),
)
def test_malformed_requests_are_refused_cleanly(
    method: str, data: st.DataObject, garbage: bytes | None, channel: grpc.Channel, known: str
) -> None:
    msg = data.draw(REQUESTS[method] if method in REQUESTS else STREAMS[method])
    if "job_id" in msg.DESCRIPTOR.fields_by_name and data.draw(st.integers(0, 3)) == 0:
        msg.job_id = known  # a real (ended) job with the other fields hostile
    body = garbage if garbage is not None else msg.SerializeToString()
    if method in STREAMS:  # on an ended job (or none) a stream ends by itself
        refused_cleanly(lambda: stream(channel, method, body, timeout=20.0))
    else:
        refused_cleanly(lambda: call(channel, method, body))
    healthy(channel, known)


# ---- HTTP ------------------------------------------------------------------------------------------

_PATHS = st.sampled_from(
    [
        "/v1/jobs?limit=100000000000000000000",
        "/v1/jobs?limit=-1",
        "/v1/jobs?limit=abc",
        "/v1/jobs?state=NOPE",
        "/v1/jobs?state=RUNNING&limit=0",
        "/v1/jobs/" + "x" * 5000,
        "/v1/jobs/%00",
        "/v1/jobs/nope",
        "/metrics?x=%ff",
        "/nope",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/?" + "a=1&" * 200,
    ]
) | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40).map(lambda s: "/" + s)


def _http(base: str, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    req = urllib.request.Request(base + path, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


@FUZZ(max_examples=100)
@given(path=_PATHS, method=st.sampled_from(["GET", "GET", "GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]))
def test_http_answers_every_request_with_a_status_and_json_errors(
    path: str, method: str, plane: ControlPlane, channel: grpc.Channel, known: str
) -> None:
    FIGURES["tried"] += 1
    assert plane.http_address is not None
    code, ctype, body = _http(plane.http_address, path.replace(" ", "%20"), method)
    if code >= 500 or (code >= 400 and method != "HEAD" and "error" not in json.loads(body)):
        FIGURES["crashes"] += 1
        raise AssertionError(f"{method} {path[:80]}: {code} {body[:200]!r}")
    assert code < 400 or method == "HEAD" or ctype == "application/json"
    FIGURES["refused" if code >= 400 else "answered"] += 1
    healthy(channel, known)


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"\x16\x03\x01\x00",
    ],
    ids=["garbage line", "70 kB target", "HTTP/9.9", "TLS hello"],
)
def test_http_malformed_request_lines_get_a_json_error(raw: bytes, plane: ControlPlane) -> None:
    FIGURES["tried"] += 1
    assert plane.http_port is not None
    with socket.create_connection(("127.0.0.1", plane.http_port), timeout=10) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/") and int(head.split()[1]) >= 400, reply[:200]
    assert "error" in json.loads(body)
    FIGURES["refused"] += 1


def test_zz_figures(channel: grpc.Channel, known: str) -> None:
    """The figures of the whole file (run last: pytest keeps the file's order)."""
    healthy(channel, known)
    print(
        f"\nfuzz: {FIGURES['tried']} hostile inputs tried, {FIGURES['refused']} refused cleanly, "
        f"{FIGURES['accepted']} accepted (each ended in a terminal state with a reason), {FIGURES['answered']} "
        f"answered over HTTP (200), {FIGURES['crashes']} crashes; "
        f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB"
    )
    assert FIGURES["crashes"] == 0
