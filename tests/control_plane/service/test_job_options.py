"""Per-job run options at Submit (issue 13), against a real server: a client sets its job's timeout,
max_restarts (up to the server's), trace and return_parameters; the server's own fields are refused with
PERMISSION_DENIED naming them; the options are kept with the job, so a job re-queued after a
control-plane restart runs under them; ``Client.submit(job, timeout=...)`` and ``sbpflow submit
--timeout/--max-restarts``."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from sbpflow.client.cli.main import main
from sbpflow.client.client import Client, ClientError
from sbpflow.control_plane.service.job_options import SERVER_FIELDS, for_run, job_options
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import SCHEMA_VERSION
from sbpflow.runs.options import CLIENT_FIELDS, MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
from sbpflow.v1 import service_pb2 as sp
from tests.client.test_client import MLP
from tests.control_plane.service.test_server import LONG, mlp, start, until  # noqa: F401 - mlp is a fixture

SERVER = MANAGER_DEFAULTS.replace(backend="inprocess", max_restarts=2, timeout=600.0)


def _state(s: sp.JobStatus) -> str:
    return sp.JobState.Name(s.state).removeprefix("JOB_STATE_")


def test_the_fields_a_client_may_set_and_the_servers_partition_the_options() -> None:
    assert set(CLIENT_FIELDS) == {"timeout", "max_restarts", "trace", "return_parameters"}
    assert set(SERVER_FIELDS) == {"backend", "ray_address", "threads"}
    mine = job_options(sp.RunOptions(timeout=5, max_restarts=1, trace=True), SERVER)
    assert (mine.timeout, mine.max_restarts, mine.trace, mine.backend) == (5.0, 1, True, "inprocess")
    # a job re-queued under a server whose limits were lowered since runs within them
    stored = sp.RunOptions(timeout=500, max_restarts=2).SerializeToString()
    assert (for_run(SERVER.replace(max_restarts=1, timeout=60.0), stored).max_restarts, 1) == (1, 1)
    assert for_run(SERVER, b"") == SERVER


@pytest.mark.parametrize(
    ("options", "code", "words"),
    [
        (sp.RunOptions(backend="ray"), grpc.StatusCode.PERMISSION_DENIED, "options.backend is set by the server"),
        (sp.RunOptions(ray_address="evil:1"), grpc.StatusCode.PERMISSION_DENIED, "ray_address is set by the server"),
        (sp.RunOptions(threads=64), grpc.StatusCode.PERMISSION_DENIED, "threads is set by the server"),
        (sp.RunOptions(max_restarts=3), grpc.StatusCode.PERMISSION_DENIED, "max_restarts=3 is more than this server allows; give at most 2"),
        (sp.RunOptions(timeout=1e9), grpc.StatusCode.PERMISSION_DENIED, "give at most 600.0"),
        (sp.RunOptions(timeout=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "RunOptions.timeout=nan"),
        (sp.RunOptions(timeout=-1), grpc.StatusCode.INVALID_ARGUMENT, "greater than 0"),
        (sp.RunOptions(max_restarts=-1), grpc.StatusCode.INVALID_ARGUMENT, "max_restarts=-1"),
    ],
)  # fmt: skip
def test_what_a_client_may_not_set_is_refused_naming_the_field(
    tmp_path: Path,
    mlp: ModuleType,  # noqa: F811
    options: sp.RunOptions,
    code: grpc.StatusCode,
    words: str,
) -> None:
    from sbpflow.codec import wire

    plane = start(tmp_path, run=SERVER)
    try:
        with grpc.insecure_channel(plane.address) as ch:
            submit = ch.unary_unary(
                "/sbpflow.v1.JobService/Submit",
                request_serializer=sp.SubmitJobRequest.SerializeToString,
                response_deserializer=sp.SubmitJobResponse.FromString,
            )
            req = sp.SubmitJobRequest(job=wire.job_to_proto(mlp.make_job(steps=1)), options=options)
            with pytest.raises(grpc.RpcError) as e:
                submit(req, timeout=30)
        assert e.value.code() == code and words in (e.value.details() or ""), e.value.details()
        assert plane.store.count() == 0  # a refused job leaves nothing behind
    finally:
        plane.stop()


def test_a_jobs_options_run_it_and_show_in_its_status(tmp_path: Path, mlp: ModuleType) -> None:  # noqa: F811
    plane = start(tmp_path, run=SERVER)
    try:
        with Client(plane.address) as c:
            quick = c.submit(mlp.make_job(steps=LONG), timeout=1.5, max_restarts=1, return_parameters=False)
            plain = c.submit(mlp.make_job(steps=2))
            assert (quick.status().options.timeout, quick.status().options.max_restarts) == (1.5, 1)
            assert (
                quick.status().options.return_parameters is False
                and quick.status().options.backend == "inprocess"
            )
            assert (
                plain.status().options == c.get(plain.job_id).options
                and plain.status().options.timeout == 600.0
            )
            final = quick.wait(timeout=60)  # the job's own timeout ended it, not the server's day
            assert _state(final) == "FAILED" and "TimeoutError" in final.message, final
            listed = {s.job_id: s.options.timeout for s in c.list()}  # List and Watch say the same
            assert listed[quick.job_id] == 1.5 and listed[plain.job_id] == 600.0
            assert all(ev.status.options.timeout == 1.5 for ev in quick.events())
            assert _state(plain.wait(timeout=60)) == "SUCCEEDED"
            with pytest.raises(ClientError) as e:
                c.submit(mlp.make_job(steps=1), backend="ray")
            assert (
                e.value.code == grpc.StatusCode.PERMISSION_DENIED and "set by the server" in e.value.details
            )
            with pytest.raises(TypeError, match="steps"):
                c.submit(mlp.make_job(steps=1), steps=3)
    finally:
        plane.stop()


def test_a_job_requeued_after_a_restart_keeps_its_options(tmp_path: Path, mlp: ModuleType) -> None:  # noqa: F811
    plane = start(tmp_path, run=SERVER, slots=2)
    try:
        with Client(plane.address) as c:
            blocker = c.submit(mlp.make_job(steps=LONG))
            until(lambda: _state(blocker.status()) == "RUNNING", "the blocker to run")
            waiting = c.submit(mlp.make_job(steps=LONG), timeout=1.5).job_id
            assert _state(c.get(waiting)) == "PENDING"
    finally:
        plane.stop()
    again = start(tmp_path, run=SERVER, slots=2)
    try:
        with Client(again.address) as c:
            assert c.get(waiting).options.timeout == 1.5
            final = c.handle(waiting).wait(timeout=60)
            assert _state(final) == "FAILED" and "TimeoutError" in final.message, final
    finally:
        again.stop()


def test_sbpflow_submit_takes_the_jobs_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plane = start(tmp_path, run=SERVER)
    try:
        args = [
            "submit",
            MLP,
            "--set",
            "steps=2",
            "--timeout",
            "90",
            "--max-restarts",
            "1",
            "--address",
            plane.address,
        ]
        assert main(args) == 0
        job_id = capsys.readouterr().out.strip()
        with Client(plane.address) as c:
            got = c.get(job_id).options
            assert (got.timeout, got.max_restarts, got.trace) == (90.0, 1, False)
        assert main([*args[:-2], "--max-restarts", "5", "--address", plane.address]) == 1
        assert "give at most 2" in capsys.readouterr().err
    finally:
        plane.stop()
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    out = capsys.readouterr().out
    assert "--timeout SECONDS" in out and "--max-restarts N" in out and "--backend" not in out
    assert "(default: the server's)" in out


def test_a_version_5_store_is_migrated_and_then_keeps_options(tmp_path: Path) -> None:
    path = tmp_path / "v5.db"
    with JobStore(path) as s:
        job_id = s.create(b"x", "j").id
    con = sqlite3.connect(path)  # what version 5 wrote: no options column
    con.executescript(  # no options column (version 6's), no cancel_requested nor its index (version 7's)
        "DROP INDEX jobs_live_resume; ALTER TABLE jobs DROP COLUMN cancel_requested; "
        "ALTER TABLE jobs DROP COLUMN options; PRAGMA user_version=5;"
    )
    con.commit()
    con.close()
    with JobStore(path) as s:
        assert s.get(job_id).options == b""
        kept = sp.RunOptions(timeout=3).SerializeToString()
        rec = s.create(b"y", "k", options=kept)
        assert s.get(rec.id).options == kept and s.get(rec.id).state == JobState.PENDING
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
