"""The control plane over real gRPC on loopback: submit, watch, cancel, list, results, restart, auth, bad
input, concurrency, health and reflection. Jobs are the tiny MLP example on the in-process backend."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import sbpflow as sf
from sbpflow.client.client import Client, ClientError
from sbpflow.codec import run_options, wire
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.v1 import job_pb2
from sbpflow.v1 import service_pb2 as sp
from tests.examples.test_examples import load

LONG = 100_000  # steps: a job that runs until it is cancelled


@pytest.fixture(scope="module")
def mlp() -> ModuleType:
    return load("mlp")


def start(tmp_path: Path, **kw: object) -> ControlPlane:
    cfg = dict(
        store=str(tmp_path / "jobs.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        slots=4,
        http_port=None,
    )
    cfg.update(kw)
    return ControlPlane(ServerConfig(**cfg)).start()  # type: ignore[arg-type]


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    p = start(tmp_path)
    yield p
    p.stop()


@pytest.fixture
def client(plane: ControlPlane) -> Iterator[Client]:
    with Client(plane.address) as c:
        yield c


def until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_submit_watch_result_and_list(client: Client, mlp: ModuleType) -> None:
    h = client.submit(mlp.make_job(steps=4))
    out = io.StringIO()
    final = h.watch(stream=out)
    assert (
        sp.JobState.Name(final.state) == "JOB_STATE_SUCCEEDED" and final.step == 4 and final.total_steps == 4
    )
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("step")]
    assert len(steps) == 4 and steps[-1].startswith("step    4/4") and "samples/s" in steps[-1]
    assert any(line.endswith(": SUCCEEDED (4 steps in " + line.split("(4 steps in ")[-1]) for line in lines)
    events = list(h.events())
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    states = [sp.JobState.Name(e.state_change.current) for e in events if e.HasField("state_change")]
    assert states == [f"JOB_STATE_{s}" for s in ("PENDING", "COMPILING", "STARTING", "RUNNING", "SUCCEEDED")]
    res = h.result()
    assert (
        res.state == "SUCCEEDED"
        and len(res.losses) == 4
        and res.losses == [e.step.loss for e in events if e.HasField("step")]
    )
    assert res.parameters["model.net.0.weight"].shape == (16, 32)
    assert list(client.result(h.job_id, ["model.net.0.bias"]).parameters) == ["model.net.0.bias"]
    assert [s.rank for s in final.workers] == [0, 1] and all(w.step == 4 for w in final.workers)
    assert h.job_id in [j.job_id for j in client.list()]
    assert client.list(states=["RUNNING"]) == []
    logs = [line.text for line in h.logs()]
    assert any("compiled" in t for t in logs) and logs[-1].startswith("SUCCEEDED")


def test_get_result_carries_the_last_value_of_what_build_returned(client: Client) -> None:
    from tests.client.nn.test_batch_norm import fit_job

    job = fit_job(2)  # build returns (loss, y): y is fetched
    (name,) = [f for f in job.fetches if f != job.loss]
    got = client.submit(job).result()
    assert got.state == "SUCCEEDED" and len(got.losses) == job.config.steps and got.omitted_fetches == []
    want = sf.run(job, backend="inprocess").outputs[name][-1]  # the same run, in this process
    np.testing.assert_allclose(got.fetches[name], want, rtol=1e-6, atol=1e-7)


def test_cancel_a_running_job(client: Client, mlp: ModuleType) -> None:
    h = client.submit(mlp.make_job(steps=LONG))
    until(lambda: h.status().step >= 2, "the job to step")
    h.cancel("enough")
    st = h.wait(timeout=30)
    assert sp.JobState.Name(st.state) == "JOB_STATE_CANCELLED"
    assert st.reason == "CANCELLED_BY_USER" and st.message == "enough" and 2 <= st.step < LONG
    assert h.result().state == "CANCELLED"
    # its workers were stopped, not broken
    rows = {w.rank: sp.WorkerState.Name(w.state) for w in h.status().workers}
    assert {0, 1} <= set(rows) and set(rows.values()) == {"WORKER_STATE_CANCELLED"}, rows


def test_a_job_that_does_not_fit_waits_then_can_be_cancelled(tmp_path: Path, mlp: ModuleType) -> None:
    p = start(tmp_path, slots=2)
    try:
        with Client(p.address) as c:
            first = c.submit(mlp.make_job(steps=LONG))
            second = c.submit(mlp.make_job(steps=2))
            st = second.status()
            assert sp.JobState.Name(st.state) == "JOB_STATE_PENDING" and st.reason == "WAITING_FOR_RESOURCES"
            assert "needs 2 of the cluster's 2 slot(s)" in st.message
            with pytest.raises(ClientError) as e:
                c.result(second.job_id)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "PENDING" in e.value.details
            assert sp.JobState.Name(second.cancel().state) == "JOB_STATE_CANCELLED"
            first.cancel()
            assert sp.JobState.Name(first.wait(30).state) == "JOB_STATE_CANCELLED"
    finally:
        p.stop()


def test_a_waiting_job_starts_when_the_first_ends(tmp_path: Path, mlp: ModuleType) -> None:
    p = start(tmp_path, slots=2)
    try:
        with Client(p.address) as c:
            first, second = c.submit(mlp.make_job(steps=3)), c.submit(mlp.make_job(steps=3))
            assert sp.JobState.Name(second.wait(30).state) == "JOB_STATE_SUCCEEDED"
            assert first.status().finished.ToNanoseconds() <= second.status().started.ToNanoseconds()
    finally:
        p.stop()


def test_restart_mid_job_reconciles_the_record(tmp_path: Path, mlp: ModuleType) -> None:
    db = tmp_path / "jobs.db"
    cmd = [sys.executable, "-m", "sbpflow.client.cli.main", "server", "--backend", "inprocess", "--slots", "2",
           "--port", "0", "--http-port", "-1", "--store", str(db)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "SBPFLOW_TOKEN": ""})
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        address = first.split("gRPC on ")[1].split()[0]
        with Client(address) as c:
            running = c.submit(mlp.make_job(steps=LONG))
            queued = c.submit(mlp.make_job(steps=3))
            until(lambda: running.status().step >= 2, "the job to step")
    finally:
        proc.kill()  # no shutdown: the process dies mid-job
        proc.wait(30)
    p = start(tmp_path, slots=2, store=str(db))
    try:
        with Client(p.address) as c:
            st = c.get(running.job_id)
            assert sp.JobState.Name(st.state) == "JOB_STATE_FAILED" and st.reason == "CONTROL_PLANE_RESTARTED"
            assert "RUNNING when the control plane stopped" in st.message and st.step >= 2
            assert len(c.result(running.job_id).losses) >= 2  # its loss history survived
            assert sp.JobState.Name(c.handle(queued.job_id).wait(30).state) == "JOB_STATE_SUCCEEDED"
    finally:
        p.stop()


def test_unauthenticated_calls_are_rejected_and_change_nothing(tmp_path: Path, mlp: ModuleType) -> None:
    p = start(tmp_path, auth_token="s3cret")
    try:
        with Client(p.address, token="s3cret") as ok:
            h = ok.submit(mlp.make_job(steps=LONG))
            until(lambda: h.status().step >= 1, "the job to step")
            for token in (None, "wrong"):
                with Client(p.address, token=token) as bad:
                    calls = [
                        lambda b=bad: b.submit(mlp.make_job(steps=2)),
                        lambda b=bad: b.cancel(h.job_id, "hostile"),
                        lambda b=bad: b.get(h.job_id),
                        lambda b=bad: b.list(),
                        lambda b=bad: list(b.watch_events(h.job_id)),
                    ]
                    for call in calls:
                        with pytest.raises(ClientError) as e:
                            call()
                        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                        assert ("no credentials" if token is None else "token is wrong") in e.value.details
            assert [j.job_id for j in ok.list()] == [h.job_id]
            assert sp.JobState.Name(h.status().state) == "JOB_STATE_RUNNING"
            # the health service stays open for probes
            with grpc.insecure_channel(p.address) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            h.cancel()
            h.wait(30)
    finally:
        p.stop()


def _raw_submit(address: str, blob: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary("/sbpflow.v1.JobService/Submit")
        with pytest.raises(grpc.RpcError) as e:
            call(blob, timeout=30)
        return e.value


def _bad(mlp: ModuleType, what: str) -> bytes:
    m = wire.job_to_proto(mlp.make_job(ranks=8 if what == "too many ranks" else 2))
    if what == "unknown op":
        m.graph.ops[2].op_type = "frobnicate"
    elif what == "shape":
        w = next(t for t in m.graph.tensors if t.name == "model.net.0.weight")
        del w.shape[:]
        w.shape.extend([17, 32])
    elif what == "sbp":
        w = next(t for t in m.graph.tensors if t.name == "model.net.0.weight")
        w.sbp.sbp.add().split.axis = 5
    elif what == "no data":
        m.ClearField("data")
    elif what == "no job":
        return sp.SubmitJobRequest(client_id="x").SerializeToString()
    elif what == "garbage":
        return b"\x0a\x05ab"
    elif what == "not a job":
        return sp.SubmitJobRequest(job=job_pb2.Job.FromString(b"\x0a\x03\xff\xfe\xfd")).SerializeToString()
    return sp.SubmitJobRequest(job=m).SerializeToString()


@pytest.mark.parametrize(
    "what, says",
    [
        ("garbage", "malformed SubmitJobRequest protobuf"),
        ("not a job", "job format version 0 is not supported"),
        ("no job", "SubmitJobRequest.job is missing"),
        ("unknown op", "frobnicate"),
        ("shape", "16 vs 17"),
        ("sbp", "model.net.0.weight"),
        ("no data", "no data source"),
        ("too many ranks", "at most 4 ranks"),
    ],
)
def test_bad_input_is_refused_with_its_message(
    plane: ControlPlane, mlp: ModuleType, what: str, says: str
) -> None:
    err = _raw_submit(plane.address, _bad(mlp, what))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert says in (err.details() or "")
    assert plane.store.count() == 0  # nothing half-created


def test_message_size_limit(tmp_path: Path, mlp: ModuleType) -> None:
    p = start(tmp_path, max_message_bytes=500)
    try:
        err = _raw_submit(p.address, _bad(mlp, "fine"))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "500" in (err.details() or "")
        assert p.store.count() == 0
    finally:
        p.stop()


def test_unknown_ids_are_not_found(client: Client) -> None:
    for call in (client.get, client.cancel, lambda i: list(client.watch_events(i)), client.result):
        with pytest.raises(ClientError) as e:
            call("nope")
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details


def test_idempotent_submit(client: Client, mlp: ModuleType) -> None:
    job = mlp.make_job(steps=2)
    a = client.submit(job, client_id="me", idempotency_key="k1")
    b = client.submit(job, client_id="me", idempotency_key="k1")
    c = client.submit(job, client_id="me", idempotency_key="k2")
    assert a.job_id == b.job_id != c.job_id
    for h in (a, c):
        h.wait(30)


def test_twenty_concurrent_submits_all_finish(tmp_path: Path, mlp: ModuleType) -> None:
    p = start(tmp_path, slots=4)
    blob = wire.job_to_proto(mlp.make_job(steps=2))
    try:
        with Client(p.address) as c:
            handles: list[object] = []
            threads = [threading.Thread(target=lambda: handles.append(c.submit(blob))) for _ in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(handles) == 20
            ends = [h.wait(60) for h in handles]  # type: ignore[attr-defined]
            assert {sp.JobState.Name(s.state) for s in ends} == {"JOB_STATE_SUCCEEDED"}
            assert len(c.list(limit=100)) == 20
    finally:
        p.stop()


def test_reflection_lists_the_services(plane: ControlPlane) -> None:
    with grpc.insecure_channel(plane.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = list(stub.ServerReflectionInfo(iter([req])))
        names = {s.name for s in resp.list_services_response.service}
    assert {"sbpflow.v1.JobService", "grpc.health.v1.Health"} <= names


def test_the_store_holds_what_the_server_said(tmp_path: Path, mlp: ModuleType) -> None:
    p = start(tmp_path)
    try:
        with Client(p.address) as c:
            h = c.submit(mlp.make_job(steps=3))
            h.wait(30)
    finally:
        p.stop()
    with JobStore(tmp_path / "jobs.db") as s:
        rec = s.get(h.job_id)
        assert rec.state.name == "SUCCEEDED" and rec.total_steps == 3 and rec.slots == 2
        assert [w.rank for w in s.workers(h.job_id)] == [0, 1] and s.result(h.job_id)


def test_a_job_on_ray_workers_reports_through_the_servers_own_worker_service_with_the_token(
    ray_local: str, tmp_path: Path, mlp: ModuleType
) -> None:
    """The whole path: Submit with a token -> compile -> 2 Ray worker processes -> their WorkerReports
    (sent with their attempt's credential) to this server's WorkerService -> per-worker states and losses."""
    plane = start(tmp_path, run=MANAGER_DEFAULTS, auth_token="s3cret", slots=2)
    try:
        assert plane.hub is not None and plane.hub.address.endswith(f":{plane.hub.port}")  # its own port
        assert plane.hub.port != plane.port
        with Client(plane.address, token="s3cret") as c:
            h = c.submit(mlp.make_job(steps=3, ranks=2))
            final = h.wait(timeout=120)
            assert sp.JobState.Name(final.state) == "JOB_STATE_SUCCEEDED", final.message
            assert [w.rank for w in final.workers] == [0, 1]
            assert all(sp.WorkerState.Name(w.state) == "WORKER_STATE_DONE" for w in final.workers)
            assert all(w.host == "127.0.0.1" for w in final.workers)
            assert len(h.result().losses) == 3
    finally:
        plane.stop()


def test_a_jobs_status_reports_the_options_it_runs_under(tmp_path: Path, mlp: ModuleType) -> None:
    options = MANAGER_DEFAULTS.replace(backend="inprocess", timeout=120.0, return_parameters=False)
    p = start(tmp_path, run=options)
    try:
        with Client(p.address) as c:
            h = c.submit(mlp.make_job(steps=2))
            assert run_options.run_options_from_proto(c.get(h.job_id).options) == options
            assert all(run_options.run_options_from_proto(j.options) == options for j in c.list())
            final = h.watch(stream=io.StringIO())
            assert run_options.run_options_from_proto(final.options) == options
            assert not h.result().parameters  # return_parameters=False: the server kept none
    finally:
        p.stop()


def test_a_port_in_use_is_refused_not_shared(tmp_path: Path) -> None:
    """gRPC's default SO_REUSEPORT let a second server start on a port in use and take part of the first
    one's connections: the second is refused, naming the address, and the first still answers."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first = start(tmp_path / "a")
    try:
        port = first.port
        with pytest.raises(
            sf.SbpflowError, match=rf"cannot bind gRPC to 127\.0\.0\.1:{port}: the port is in use"
        ):
            start(tmp_path / "b", port=port)
        with Client(first.address) as c:
            assert c.list() == []
    finally:
        first.stop()


def test_port_zero_on_a_name_of_several_addresses_is_free_on_each() -> None:
    """``localhost`` is 127.0.0.1 and ::1 on many machines: gRPC gives the second the first one's port,
    and where another process holds it there, that process got the clients (seen on CI)."""
    from sbpflow.control_plane.launch.ports import free_on_all, free_port

    addresses = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "127.0.0.2")]
    for _ in range(5):
        port = free_on_all(addresses)
        held = [socket.socket(family) for family, _ in addresses]
        try:
            for s, (_, address) in zip(held, addresses, strict=True):
                s.bind((address, port))  # raises where the port was taken on one of them
        finally:
            for s in held:
                s.close()
    assert free_port("localhost", 8123) == 8123 and free_port("127.0.0.1", 0) == 0
