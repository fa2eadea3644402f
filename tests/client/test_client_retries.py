"""``sf.Client``'s retries and idempotency keys against a real control plane on loopback (backend
inprocess): a storm of Submits with 1 ms deadlines makes exactly one job per logical call, a Submit that
meets no server yet gets through once one listens, and a server's ``retry-after-ms`` hint is waited for."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from sbpflow.client.client import RETRY_AFTER, Client, ClientError, RetryPolicy
from sbpflow.codec.wire import job_to_proto
from sbpflow.control_plane.service.isolation import CLIENT_ID_KEY
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.v1 import service_pb2 as sp
from sbpflow.v1 import service_pb2_grpc as sg
from tests.examples.test_examples import load

CALLS = 40  # logical Submits in the storm (~80 ms of compiling each on the server; 100 took 17-85 s)


def _config(tmp: Path, port: int = 0) -> ServerConfig:
    run = MANAGER_DEFAULTS.replace(backend="inprocess")
    return ServerConfig(store=str(tmp / "jobs.db"), run=run, slots=1, http_port=None, port=port)


@pytest.fixture(scope="module")
def tiny_job() -> Any:
    return job_to_proto(load("mlp").make_job(ranks=1, hidden=4, layers=1, steps=1))


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    p = ControlPlane(_config(tmp_path)).start()
    yield p
    p.stop()


def test_storm_of_tiny_deadlines_makes_one_job_per_logical_call(plane: ControlPlane, tiny_job: Any) -> None:
    # each attempt gives up after 1 ms, mostly while the server still compiles the job and stores it: a
    # retry without the attempt's key would store it again
    hasty = Client(
        plane.address, timeout=0.001, retry=RetryPolicy(attempts=4, backoff=0.001, max_backoff=0.01)
    )
    patient = Client(plane.address)
    ids, gave_up = [], 0
    with hasty, patient:
        for _ in range(CALLS):
            try:
                ids.append(hasty.submit(tiny_job).job_id)
            except ClientError as e:
                assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED and len(e.idempotency_key) == 32
                gave_up += 1  # the caller retries the same logical call, with the key the error names
                ids.append(patient.submit(tiny_job, idempotency_key=e.idempotency_key).job_id)
        stored = patient.list(limit=10 * CALLS)
    assert gave_up > CALLS // 2  # the storm did hit its deadlines
    assert len(set(ids)) == CALLS
    assert sorted(st.job_id for st in stored) == sorted(ids)


def test_an_explicit_key_is_kept_and_a_missing_one_is_fresh(plane: ControlPlane, tiny_job: Any) -> None:
    with Client(plane.address) as c:
        first = c.submit(tiny_job, idempotency_key="build-42")
        assert c.submit(tiny_job, idempotency_key="build-42").job_id == first.job_id
        assert c.submit(tiny_job).job_id != c.submit(tiny_job).job_id  # no key given: a fresh one each
        assert len(c.list()) == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_submit_before_the_server_listens_gets_through_once(tmp_path: Path, tiny_job: Any) -> None:
    port = _free_port()
    started: list[ControlPlane] = []
    late = threading.Timer(1.0, lambda: started.append(ControlPlane(_config(tmp_path, port)).start()))
    late.start()
    try:
        policy = RetryPolicy(attempts=200, backoff=0.05, max_backoff=0.2, deadline=30.0)
        with Client(f"127.0.0.1:{port}", retry=policy) as c:
            handle = c.submit(tiny_job)
            assert [st.job_id for st in c.list()] == [handle.job_id]
    finally:
        late.join()
        for p in started:
            p.stop()


def test_no_server_fails_within_the_policy(tiny_job: Any) -> None:
    policy = RetryPolicy(attempts=3, backoff=0.01, max_backoff=0.02)
    t0 = time.monotonic()
    with Client(f"127.0.0.1:{_free_port()}", retry=policy) as c, pytest.raises(ClientError) as e:
        c.submit(tiny_job, idempotency_key="k1")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "no control plane at" in str(e.value)
    assert e.value.idempotency_key == "k1" and time.monotonic() - t0 < 10


class _Crowded(sg.JobServiceServicer):
    """A JobService that answers its first Submits RESOURCE_EXHAUSTED with a retry hint (as a control
    plane over its admission budget does), then takes the job."""

    def __init__(self, refusals: int, hint_ms: str | None) -> None:
        self.refusals, self.hint_ms = refusals, hint_ms
        self.calls: list[float] = []
        self.client_ids: list[str] = []

    def Submit(self, request: sp.SubmitJobRequest, context: grpc.ServicerContext) -> sp.SubmitJobResponse:
        self.calls.append(time.monotonic())
        self.client_ids.append(dict(context.invocation_metadata()).get(CLIENT_ID_KEY, ""))
        if len(self.calls) <= self.refusals:
            if self.hint_ms is not None:
                context.set_trailing_metadata(((RETRY_AFTER, self.hint_ms),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many jobs being admitted; retry later")
        return sp.SubmitJobResponse(job_id=request.idempotency_key[:16])


@pytest.fixture
def crowded() -> Iterator[tuple[str, Any]]:
    def start(refusals: int, hint_ms: str | None) -> tuple[str, _Crowded]:
        service = _Crowded(refusals, hint_ms)  # type: ignore[abstract]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        sg.add_JobServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", service

    servers: list[grpc.Server] = []
    yield start  # type: ignore[misc]
    for s in servers:
        s.stop(None)


def test_resource_exhausted_waits_for_the_servers_hint(crowded: Any, tiny_job: Any) -> None:
    address, service = crowded(2, "300")
    with Client(address) as c:
        assert c.submit(tiny_job, idempotency_key="abcdef0123456789xyz").job_id == "abcdef0123456789"
    gaps = [b - a for a, b in zip(service.calls, service.calls[1:], strict=False)]
    assert len(service.calls) == 3 and all(g >= 0.29 for g in gaps)


def test_each_client_names_itself_on_every_attempt(crowded: Any, tiny_job: Any) -> None:
    # the server's fair shares count by this id: two Clients of one process share gRPC's pooled
    # connection, so without it they would share one share
    address, service = crowded(1, "10")
    with Client(address) as a, Client(address) as b, Client(address, client_id="trainer-7") as named:
        a.submit(tiny_job)  # refused once, then taken: two attempts, one id
        b.submit(tiny_job)
        named.submit(tiny_job)
    first, again, other, given = service.client_ids
    assert first == again == a.client_id and other == b.client_id and given == "trainer-7"
    assert len(first) == 32 and first != other


@pytest.mark.parametrize("hint", [None, "soon"])
def test_resource_exhausted_without_a_readable_hint_is_not_retried(
    crowded: Any, tiny_job: Any, hint: Any
) -> None:
    address, service = crowded(1, hint)
    with Client(address) as c, pytest.raises(ClientError) as e:
        c.submit(tiny_job)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and len(service.calls) == 1


def test_resume_sends_a_key_so_a_retried_resume_is_one_job(tmp_path: Path) -> None:
    cfg = dataclasses.replace(_config(tmp_path), checkpoint_root=str(tmp_path / "ck"))
    job = load("mlp").make_job(ranks=1, hidden=4, layers=1, steps=2)
    job = dataclasses.replace(job, config=dataclasses.replace(job.config, checkpoint_every=1))
    p = ControlPlane(cfg).start()
    try:
        with Client(p.address) as c:
            ended = c.submit(job)
            assert sp.JobState.Name(ended.wait(60).state) == "JOB_STATE_SUCCEEDED"
            more = dataclasses.replace(job, config=dataclasses.replace(job.config, steps=3))
            again = c.resume(ended.job_id, more, idempotency_key="resume-1")
            assert c.resume(ended.job_id, more, idempotency_key="resume-1").job_id == again.job_id
            assert again.status().resumed_from == ended.job_id and len(c.list()) == 2
    finally:
        p.stop()
