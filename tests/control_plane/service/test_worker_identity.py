"""Worker identity (issue 13): each attempt's workers report with a credential the control plane minted
for that job and attempt, not the client token; the WorkerService checks it, the attempt, the rank and
the step order. Forged reports come from a plain gRPC client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from sbpflow.actor_workers.step_reports import report
from sbpflow.client.client import Client
from sbpflow.control_plane.launch.report_hub import ReportHub
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.v1 import service_pb2 as sp
from sbpflow.v1 import service_pb2_grpc as sg
from tests.control_plane.service.test_server import LONG, mlp, start, until  # noqa: F401 - mlp is a fixture


def _call(stub: Any, msg: sp.WorkerReport, credential: str | None) -> grpc.StatusCode | bool:
    """The code a report is refused with, or (delivered) the ack's cancel flag."""
    metadata = (("authorization", f"Bearer {credential}"),) if credential is not None else ()
    try:
        return bool(stub.Report(msg, timeout=10, metadata=metadata).cancel)
    except grpc.RpcError as e:
        assert e.details(), "a refusal says why"
        return e.code()


def _step(job: str, attempt: int, rank: int, step: int) -> sp.WorkerReport:
    return report(job, attempt, rank, step=sp.StepReport(step=step, losses=[1.0], loss=1.0))


@pytest.fixture
def hub() -> Iterator[tuple[ReportHub, Any]]:
    h = ReportHub()
    address = h.serve()
    with grpc.insecure_channel(address) as channel:
        yield h, sg.WorkerServiceStub(channel)
    h.stop()


def test_reports_need_their_attempts_credential_rank_and_forward_steps(hub: tuple[ReportHub, Any]) -> None:
    h, stub = hub
    got: list[sp.WorkerReport] = []
    beat = report("j", 1, 0, heartbeat=sp.Heartbeat())
    assert _call(stub, beat, h.credential("j", 1)) == grpc.StatusCode.FAILED_PRECONDITION  # not running
    with h.listen("j", 1, got.append, ranks=[0, 1]) as cred:
        assert cred == h.credential("j", 1) and cred != h.credential("j", 2) != h.credential("k", 1)
        assert _call(stub, beat, None) == grpc.StatusCode.PERMISSION_DENIED
        assert _call(stub, beat, "client-token") == grpc.StatusCode.PERMISSION_DENIED
        assert _call(stub, beat, h.credential("k", 1)) == grpc.StatusCode.PERMISSION_DENIED  # other job's
        assert _call(stub, beat, cred) is False
        old = report("j", 2, 0, heartbeat=sp.Heartbeat())
        assert _call(stub, old, h.credential("j", 2)) == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            _call(stub, report("j", 1, 999, heartbeat=sp.Heartbeat()), cred)
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert _call(stub, _step("j", 1, 0, 1), cred) is False
        assert _call(stub, _step("j", 1, 0, 2), cred) is False
        assert _call(stub, _step("j", 1, 0, 2), cred) == grpc.StatusCode.INVALID_ARGUMENT  # not forward
        assert _call(stub, _step("j", 1, 1, 1), cred) is False  # per rank
        h.cancel("j")
        assert _call(stub, beat, cred) is True
    assert _call(stub, beat, cred) == grpc.StatusCode.FAILED_PRECONDITION  # the attempt has ended
    assert [(r.rank, r.WhichOneof("payload")) for r in got] == [
        (0, "heartbeat"), (0, "step"), (0, "step"), (1, "step"), (0, "heartbeat")
    ]  # fmt: skip


def test_ray_workers_report_with_their_credential_and_forged_reports_are_refused(
    ray_local: str,
    tmp_path: Path,
    mlp: ModuleType,  # noqa: F811
) -> None:
    """A server with a client token and 2 Ray workers: the workers' reports are taken (the job's steps
    grow) while the client token, a rank outside the job, an old step or another attempt are refused, and
    nothing forged shows in the job's workers or logs."""
    plane = start(tmp_path, run=MANAGER_DEFAULTS, auth_token="s3cret", slots=2)
    try:
        assert plane.hub is not None
        with Client(plane.address, token="s3cret") as c, grpc.insecure_channel(plane.hub.address) as ch:
            h = c.submit(mlp.make_job(steps=LONG, ranks=2))
            until(lambda: h.status().step >= 2, "the workers' step reports", timeout=120)
            stub, job = sg.WorkerServiceStub(ch), h.job_id
            cred = plane.hub.credential(job, 1)
            forged = report(job, 1, 999, log=sp.LogLine(rank=999, level="ERROR", text="forged error"))
            assert _call(stub, forged, "s3cret") == grpc.StatusCode.PERMISSION_DENIED
            assert _call(stub, forged, cred) == grpc.StatusCode.INVALID_ARGUMENT
            assert _call(stub, _step(job, 1, 0, 1), cred) == grpc.StatusCode.INVALID_ARGUMENT
            other = report(job, 2, 0, log=sp.LogLine(rank=0, level="ERROR", text="forged error"))
            assert _call(stub, other, plane.hub.credential(job, 2)) == grpc.StatusCode.FAILED_PRECONDITION
            h.cancel("done")
            final = h.wait(timeout=60)
            assert sp.JobState.Name(final.state) == "JOB_STATE_CANCELLED", final.message
            assert sorted(w.rank for w in final.workers) == [0, 1]
            assert _call(stub, forged, cred) == grpc.StatusCode.FAILED_PRECONDITION  # ended
            assert not [line for line in c.logs(job) if "forged" in line.text]
    finally:
        plane.stop()
