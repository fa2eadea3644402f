"""Data access policy and isolation (issue 13), against a real server over loopback: data files only
under --data-root (symlinks and .. included), no file bytes in an error; streams capped so that Get still
answers; /readyz 503 when the store cannot write; a store write failure is UNAVAILABLE; per-job series
expire and carry no long names; no open bind without a token; each client, connection and host held to its
fair share of the calls in flight (a refusal RESOURCE_EXHAUSTED with a retry hint, never CANCELLED);
oversize metadata refused before the token is checked."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest

from sbpflow.client.client import Client, JobHandle
from sbpflow.codec import wire
from sbpflow.control_plane.service import run_listeners
from sbpflow.control_plane.service.data_policy import DataPolicy
from sbpflow.control_plane.service.isolation import (
    CLIENT_ID_KEY,
    MAX_CLIENT_ID,
    MAX_METADATA_BYTES,
    RETRY_AFTER_KEY,
    STREAMS_PER_CONNECTION,
    CallCounter,
    Caller,
    Fairness,
    InsecureBind,
    Shares,
    is_loopback,
    transport_options,
)
from sbpflow.control_plane.service.job_feed import CONFLATE_AT, JobFeed, conflated
from sbpflow.control_plane.service.server import ControlPlane
from sbpflow.control_plane.status import metrics as metrics_module
from sbpflow.control_plane.status.records import job_events
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import JobEvent, JobRecord
from sbpflow.data.sources import ArrayFileSource, DataError, TokenFileSource
from sbpflow.errors import SbpflowError
from sbpflow.job import Job
from sbpflow.runs.states import JobState
from sbpflow.v1 import service_pb2 as sp
from tests.control_plane.service.test_server import LONG, mlp, start, until  # noqa: F401 - mlp is a fixture


def _submit(address: str, blob: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary("/sbpflow.v1.JobService/Submit")
        req = sp.SubmitJobRequest()
        req.job.ParseFromString(blob)
        with pytest.raises(grpc.RpcError) as e:
            call(req.SerializeToString(), timeout=30)
        return e.value


def _with_files(example: ModuleType, tmp_path: Path, where: Path) -> bytes:
    job = example.make_job(steps=2)
    batch = job.data.read(0)
    paths = {}
    for k, v in batch.items():
        paths[k] = str(where / f"{k}.npy")
        np.save(tmp_path / f"{k}.npy", np.concatenate([v] * 4))
    return wire.job_to_proto(
        dataclasses.replace(job, data=ArrayFileSource(paths=paths, batch_size=job.data.batch_size))
    ).SerializeToString()


def test_data_outside_the_roots_is_refused_naming_them(tmp_path: Path, mlp: ModuleType) -> None:  # noqa: F811
    root = tmp_path / "data"
    root.mkdir()
    (root / "escape").symlink_to("/etc")
    plane = start(tmp_path, data_roots=(str(root),))
    try:
        token_job = dataclasses.replace(
            mlp.make_job(steps=2), data=TokenFileSource(path="/etc/passwd", seq_len=4, batch_size=2)
        )
        for path in (
            "/etc/passwd",
            str(root / "escape" / "passwd"),
            str(root / ".." / ".." / "etc" / "passwd"),
        ):
            blob = wire.job_to_proto(
                dataclasses.replace(token_job, data=TokenFileSource(path=path, seq_len=4, batch_size=2))
            ).SerializeToString()
            err = _submit(plane.address, blob)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
            assert str(root.resolve()) in err.details() and "--data-root" in err.details()
            assert "root:" not in err.details()
        assert plane.store.count() == 0  # a refused job leaves nothing behind
        (root / "x.npy").write_bytes(b"")  # under the root: admitted past the policy
        blob = _with_files(mlp, root, root)
        with Client(plane.address) as c:
            h = c.submit(wire.job_from_proto(_proto(blob)))
            assert sp.JobState.Name(h.wait(timeout=60).state) == "JOB_STATE_SUCCEEDED"
    finally:
        plane.stop()
    (tmp_path / "n").mkdir()
    nothing = start(tmp_path / "n")
    try:
        err = _submit(nothing.address, _with_files(mlp, root, root))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "no --data-root" in err.details()
    finally:
        nothing.stop()


def _proto(blob: bytes) -> Any:
    from sbpflow.v1 import job_pb2

    return job_pb2.Job.FromString(blob)


def test_a_npy_reader_error_carries_no_file_bytes(tmp_path: Path) -> None:
    bad = tmp_path / "x.npy"
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (secretbytes, ), }"
    bad.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    with pytest.raises(DataError) as e:
        ArrayFileSource(paths={"x": str(bad)}, batch_size=1).fields()
    assert "secretbytes" not in str(e.value) and e.value.__suppress_context__


def test_the_embedded_policy_allows_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    policy = DataPolicy.embedded()
    assert policy.allows("tokens.bin") and policy.allows(str(tmp_path / "a" / "b.npy"))
    assert (
        not policy.allows("/etc/passwd") and not policy.allows("../elsewhere") and not policy.allows("a\0b")
    )


def _watch(address: str, client_id: str) -> tuple[grpc.Channel, Any]:
    """A channel with a connection of its own, and Watch on it as the client ``client_id``."""
    # channel arguments of its own: gRPC shares a connection between the channels whose arguments are equal
    channel = grpc.insecure_channel(address, options=[("sbpflow.test.client", client_id)])
    watch = channel.unary_stream(
        "/sbpflow.v1.JobService/Watch",
        request_serializer=sp.WatchJobRequest.SerializeToString,
        response_deserializer=sp.JobEvent.FromString,
    )
    return channel, lambda job_id: watch(
        sp.WatchJobRequest(job_id=job_id), metadata=((CLIENT_ID_KEY, client_id),)
    )


def _refused(call: Any, *words: str) -> grpc.RpcError:
    """``call()`` refused RESOURCE_EXHAUSTED, with ``words`` and a retry hint in the message and the trailers."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    err = e.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert all(w in err.details() for w in (*words, "retry after")), err.details()
    assert any(k == RETRY_AFTER_KEY and int(v) > 0 for k, v in err.trailing_metadata()), (
        err.trailing_metadata()
    )
    return err


def test_streams_past_a_fair_share_are_refused_and_get_still_answers(tmp_path: Path, mlp: ModuleType) -> None:  # noqa: F811
    """A test-sized form of bench/control_plane/streams.py: 40 streams at most (4 unary threads), so a client
    holds 20, a connection 25, a host 30 and a newcomer on that host one more; 100 Gets are answered meanwhile (p99 printed,
    not asserted: timings belong to the bench); the server's own limit refuses past --max-streams."""
    plane = start(tmp_path, threads=4, max_streams=40, http_port=0)
    channels = []
    try:
        with Client(plane.address) as c:
            job_id = c.submit(mlp.make_job(steps=LONG)).job_id
        (ca, a), (cb, b), (cc, newcomer) = (_watch(plane.address, who) for who in "abc")
        channels += [ca, cb, cc]
        streams = [a(job_id) for _ in range(20)] + [b(job_id) for _ in range(10)]
        for s in streams:
            next(s)  # each holds its handler now
        until(lambda: plane.streams.open == 30, "30 open streams")
        _refused(lambda: next(a(job_id)), "client id 'a'", "has 20 streams in flight, the limit is 20")
        _refused(lambda: next(b(job_id)), "host ipv4:127.0.0.1 has 30 streams in flight, the limit is 30")
        streams.append(newcomer(job_id))
        next(streams[-1])  # nothing in flight from c: admitted past the host's share
        get = ca.unary_unary(
            "/sbpflow.v1.JobService/Get",
            request_serializer=sp.GetJobRequest.SerializeToString,
            response_deserializer=sp.JobStatus.FromString,
        )
        times = []
        for _ in range(100):
            t = time.perf_counter()
            get(sp.GetJobRequest(job_id=job_id), timeout=5)
            times.append(time.perf_counter() - t)
        p99 = float(np.percentile(times, 99))
        print(f"\n31 streams held, 100 Gets: p50 {np.median(times) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
        assert urllib.request.urlopen(f"{plane.http_address}/readyz", timeout=5).status == 200
        for s in streams:
            s.cancel()
        until(lambda: plane.streams.open == 0, "streams released")
        until(lambda: not plane.capacity.fair_streams.held, "every share released")
    finally:
        for ch in channels:
            ch.close()
        plane.stop()
    one = start(
        tmp_path, store=str(tmp_path / "one.db"), threads=4, max_streams=1
    )  # a share of 1 and a newcomer: the gate binds
    try:
        with Client(one.address) as c:
            job_id = c.submit(mlp.make_job(steps=LONG)).job_id
        (ca, a), (cb, b) = _watch(one.address, "a"), _watch(one.address, "b")
        held = a(job_id)
        next(held)
        _refused(lambda: next(b(job_id)), "1 streams are open, the server's limit (--max-streams)")
        held.cancel()
        ca.close(), cb.close()
    finally:
        one.stop()


def test_a_flood_from_one_client_is_answered_ok_or_resource_exhausted_and_a_bystander_is_served(
    tmp_path: Path,
) -> None:
    """1,500 Gets at once from one client (a test-sized bench/control_plane/grpc_flood.py): each is answered
    OK or RESOURCE_EXHAUSTED with a retry hint -- gRPC's own backlog limit used to cancel some (CANCELLED) --
    and a bystander's Gets on the same host are answered meanwhile, within a bound generous for a busy
    machine (the bench measures the latency)."""
    plane = start(tmp_path, threads=8)
    job_id = plane.store.create(b"", "flooded").id
    flood, side = grpc.insecure_channel(plane.address), grpc.insecure_channel(plane.address)
    try:
        gets = [
            ch.unary_unary(
                "/sbpflow.v1.JobService/Get",
                request_serializer=sp.GetJobRequest.SerializeToString,
                response_deserializer=sp.JobStatus.FromString,
            )
            for ch in (flood, side)
        ]
        req = sp.GetJobRequest(job_id=job_id)
        gets[1](req, timeout=30)  # the bystander is connected
        done, seen = threading.Event(), []

        def bystander() -> None:
            while not done.is_set():
                t = time.perf_counter()
                try:
                    gets[1](req, timeout=30, metadata=((CLIENT_ID_KEY, "bystander"),))
                    seen.append((time.perf_counter() - t, grpc.StatusCode.OK))
                except grpc.RpcError as e:
                    seen.append((time.perf_counter() - t, e.code()))

        by = threading.Thread(target=bystander)
        by.start()
        calls = [gets[0].future(req, timeout=30, metadata=((CLIENT_ID_KEY, "flood"),)) for _ in range(1500)]
        errors = [f.exception() for f in calls]
        done.set()
        by.join()
        codes = collections.Counter(e.code() if e else grpc.StatusCode.OK for e in errors)
        print(
            f"\n1,500 Gets at once: {dict(codes)}; bystander: {len(seen)} Gets, max {max(t for t, _ in seen):.2f} s"
        )
        assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        refused = [e for e in errors if e]
        share = "client id 'flood' of ipv4:127.0.0.1 has 4 unary calls in flight, the limit is 4"
        assert any(share in e.details() for e in refused) and all(
            "retry after" in e.details() for e in refused
        )
        refusal = refused[0]
        assert dict(refusal.trailing_metadata())[RETRY_AFTER_KEY] == "100"
        assert seen and max(t for t, _ in seen) < 5.0, seen
        assert {c for _, c in seen} <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, seen
        assert grpc.StatusCode.OK in {c for _, c in seen}
        until(lambda: not plane.capacity.fair_unary.held and plane.unary.busy == 0, "every call released")
    finally:
        flood.close(), side.close()
        plane.stop()


def test_fair_shares_hold_a_client_that_rotates_ids_and_leave_room_for_a_bystander() -> None:
    fair = Fairness(Shares.of(8, 100), "unary calls")  # client 4, connection 5, host 6, a newcomer 1 more
    shares = fair.shares
    assert (shares.client, shares.connection, shares.host, shares.newcomer) == (4, 5, 6, 1)
    one = Caller.of("ipv4:10.0.0.7:5000", [(CLIENT_ID_KEY, "one")])
    assert [fair.enter(one) for _ in range(4)] == [""] * 4
    assert fair.enter(one) == "client id 'one' of ipv4:10.0.0.7 has 4 unary calls in flight, the limit is 4"
    fair.leave(one)
    rotating = [Caller.of("ipv4:10.0.0.7:5000", [(CLIENT_ID_KEY, f"id-{i}")]) for i in range(3)]
    assert [fair.enter(c) for c in rotating] == ["", "", f"connection {one.connection} has 5 unary calls in "
                                                "flight, the limit is 5"]  # fmt: skip
    second = Caller.of("ipv4:10.0.0.7:5001", [(CLIENT_ID_KEY, "other")])  # the same host: up to its share
    assert fair.enter(second) == ""  # a newcomer: past the host's share of 6
    assert fair.enter(second) == "host ipv4:10.0.0.7 has 6 unary calls in flight, the limit is 6"
    bystander = Caller.of("ipv4:10.0.0.7:6000", [(CLIENT_ID_KEY, b"me")])
    assert fair.enter(bystander) == ""  # nothing in flight: a newcomer too
    late = Caller.of("ipv4:10.0.0.7:6001", ())
    assert fair.enter(late) == "host ipv4:10.0.0.7 has 7 unary calls in flight, the limit is 7"
    assert fair.enter(Caller.of("ipv6:[::1]:7000", ())) == ""  # another host has its own share
    assert Caller.of("ipv4:10.0.0.7:9", [(CLIENT_ID_KEY, "x" * 999)]).client == f"id {'x' * MAX_CLIENT_ID!r}"
    for c in (one, one, one, *rotating[:2], second, bystander, Caller.of("ipv6:[::1]:7000", ())):
        fair.leave(c)
    assert not fair.held  # the table forgets callers with nothing in flight


def test_oversize_metadata_is_refused_before_the_token_is_checked(tmp_path: Path) -> None:
    plane = start(tmp_path, auth_token="secret")
    try:
        with grpc.insecure_channel(plane.address) as ch:
            get = ch.unary_unary(
                "/sbpflow.v1.JobService/Get", request_serializer=sp.GetJobRequest.SerializeToString
            )
            big = (("x-pad", "a" * (2 * MAX_METADATA_BYTES + 1)),)
            with pytest.raises(grpc.RpcError) as e:
                get(sp.GetJobRequest(job_id="x"), timeout=10, metadata=big)
            assert (
                e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size" in e.value.details()
            )
            with pytest.raises(grpc.RpcError) as e:  # the connection still serves: this one meets the token
                get(sp.GetJobRequest(job_id="x"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert dict(transport_options())["grpc.max_concurrent_streams"] == STREAMS_PER_CONNECTION
    finally:
        plane.stop()


class Full:
    """SQLite's answer on a full disk, for every write (reads go to ``real``)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def execute(self, sql: str, *a: object) -> object:
        import sqlite3

        if sql.startswith(("INSERT", "UPDATE", "COMMIT", "BEGIN")):
            raise sqlite3.OperationalError("database or disk is full")
        return self.real.execute(sql, *a)


def test_a_store_that_cannot_write_is_unavailable_and_not_ready(tmp_path: Path, mlp: ModuleType) -> None:  # noqa: F811
    plane = start(tmp_path, http_port=0)
    try:
        real = plane.store._db
        plane.store._db = Full(real)  # type: ignore[assignment]
        err = _submit(plane.address, wire.job_to_proto(mlp.make_job(steps=2)).SerializeToString())
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "disk is full" in err.details()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{plane.http_address}/readyz", timeout=5)
        assert e.value.code == 503 and "cannot write" in json.loads(e.value.read())["reason"]
        plane.store._db = real
        with Client(plane.address) as c:
            c.submit(mlp.make_job(steps=2)).wait(timeout=60)
        assert urllib.request.urlopen(f"{plane.http_address}/readyz", timeout=5).status == 200
    finally:
        plane.stop()


@contextlib.contextmanager
def store_outage(plane: ControlPlane, job: Job, after_step: int) -> Iterator[JobHandle]:
    """Submit ``job``; once it has trained ``after_step`` steps, the store's disk is full for the body."""
    real = plane.store._db
    c = Client(plane.address)
    h = c.submit(job)
    until(lambda: c.get(h.job_id).step >= after_step, f"step {after_step}", 60)
    plane.store._db = Full(real)  # type: ignore[assignment]
    try:
        yield h
    finally:
        plane.store._db = real


def test_a_store_outage_mid_run_loses_no_step_and_the_job_succeeds(tmp_path: Path, mlp: ModuleType) -> None:  # noqa: F811
    plane = start(tmp_path, http_port=0)
    try:
        with store_outage(plane, mlp.make_job(steps=300), 5) as h:
            time.sleep(0.3)  # steps go on meanwhile; their rows are held
        st = h.wait(120)
        assert st.state == sp.JOB_STATE_SUCCEEDED and st.step == 300, st
        assert [p.step for p in plane.store.losses(h.job_id)] == list(range(1, 301))
        assert len(h.result().losses) == 300
    finally:
        plane.stop()


def test_a_store_gone_too_long_cancels_the_run_saying_why(
    tmp_path: Path,
    mlp: ModuleType,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(run_listeners, "MAX_UNWRITTEN", 20)
    plane = start(tmp_path, http_port=0)
    try:
        with store_outage(plane, mlp.make_job(steps=100_000), 2) as h:
            until(lambda: plane.manager._running[h.job_id].cancel.is_set(), "the run cancelled", 60)
        st = h.wait(120)
        assert st.state == sp.JOB_STATE_CANCELLED, st
        assert "the job store could not write for 20 writes in a row" in st.message
        assert "database or disk is full" in st.message and "then resume the job" in st.message
    finally:
        plane.stop()


def test_a_store_gone_past_the_end_of_a_run_lets_the_run_go_and_keeps_the_job(
    tmp_path: Path,
    mlp: ModuleType,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sbpflow.control_plane.service import jobs

    monkeypatch.setattr(jobs, "STORE_FLUSH_SECONDS", 0.5)
    plane = start(tmp_path, http_port=0)
    try:
        with store_outage(plane, mlp.make_job(steps=20), 2) as h:  # the run ends while the disk is full
            until(lambda: h.job_id not in plane.manager._running, "the manager to let go of the run", 60)
            assert plane.store.get(h.job_id).state == JobState.RUNNING  # never a terminal state unwritten
        with Client(plane.address) as c:
            assert c.submit(mlp.make_job(steps=2)).wait(60).state == sp.JOB_STATE_SUCCEEDED  # slots freed
    finally:
        plane.stop()


def test_per_job_series_expire_and_names_are_cut(
    tmp_path: Path,
    mlp: ModuleType,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plane = start(tmp_path)
    try:
        job = dataclasses.replace(mlp.make_job(steps=2), name="n" * 200)
        with Client(plane.address) as c:
            job_id = c.submit(job).job_id
            c.get(job_id)
            until(lambda: plane.store.get(job_id).state.terminal, "the job to end")
        text = plane.manager.metrics.exposition().decode()  # type: ignore[union-attr]
        assert job_id in text and "n" * 65 not in text and "n" * 64 in text
        monkeypatch.setattr(metrics_module, "EXPIRE_SECONDS", -1.0)
        assert job_id not in plane.manager.metrics.exposition().decode()  # type: ignore[union-attr]
    finally:
        plane.stop()


def test_a_non_loopback_bind_needs_a_token_or_insecure(tmp_path: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    with pytest.raises(InsecureBind, match="--insecure"):
        start(tmp_path, host="0.0.0.0", store=str(tmp_path / "a.db"))
    for extra in ({"auth_token": "t"}, {"insecure": True}):
        p = start(tmp_path, host="0.0.0.0", store=str(tmp_path / f"{len(extra)}{list(extra)[0]}.db"), **extra)
        p.stop()
    from sbpflow.client.cli.jobs import server_config
    from sbpflow.client.cli.main import build_parser

    args = build_parser().parse_args(
        ["server", "--data-root", "/a", "--data-root", "/b", "--insecure", "--max-streams", "9"]
    )
    cfg = server_config(args)
    assert cfg.data_roots == ("/a", "/b") and cfg.insecure and cfg.max_streams == 9
    assert isinstance(InsecureBind("x"), SbpflowError)


class _CountingStore:
    """A job store that counts ``get`` and ``events`` calls."""

    def __init__(self, store: JobStore) -> None:
        self.store, self.reads = store, 0

    def get(self, job_id: str) -> JobRecord:
        self.reads += 1
        return self.store.get(job_id)

    def events(self, job_id: str, after_seq: int = 0) -> list[JobEvent]:
        self.reads += 1
        return self.store.events(job_id, after_seq)


def test_a_follower_is_woken_by_its_own_job_only_and_followers_share_one_read() -> None:
    store = JobStore(":memory:")
    a, b = (store.create(b"", name).id for name in ("a", "b"))
    counting = _CountingStore(store)
    feed = JobFeed(counting, min_interval=0.0)  # type: ignore[arg-type]
    with contextlib.ExitStack() as followers:
        followers.enter_context(feed.following(a))
        for _ in range(50):
            followers.enter_context(feed.following(b))
        seen_b = feed.job_version(b)
        for _ in range(3):
            store.set_reason(a, "R", f"a changed {_}")
            feed.notify(a)
        assert feed.job_version(b) == seen_b  # job A's writes do not wake job B's followers
        assert all(len(feed.read(b, 0, None, seen_b, 60.0)[0]) == 1 for _ in range(50))
        assert counting.reads == 2  # 50 followers of B: one store.get + store.events between them
        store.set_reason(b, "R", "b changed")
        feed.notify(b)
        seen_b = feed.job_version(b)
        got = [feed.read(b, 1, None, seen_b, 60.0)[0] for _ in range(50)]
        assert counting.reads == 4 and all([e.seq for e in g] == [2] for g in got)
        assert {g[0].status.message for g in got} == {"b changed"}
        replay, ended = feed.read(a, 0, None, feed.job_version(a), 60.0)  # A's own tail, from the start
        assert [e.seq for e in replay] == [1, 2, 3, 4] and not ended


def test_many_live_followers_get_runs_of_step_events_as_their_newest_and_a_replay_gets_all() -> None:
    store = JobStore(":memory:")
    job = store.create(b"", "busy").id  # event 1: created
    feed = JobFeed(store, min_interval=0.0)
    with contextlib.ExitStack() as followers:
        for _ in range(CONFLATE_AT + 1):
            followers.enter_context(feed.following(job))
        live, _ = feed.read(job, 0, None, feed.job_version(job), 60.0)  # the tail starts at event 1
        for step in range(1, 6):  # events 2-6
            store.record_step(job, step, 1.0 / step, 10.0)
        store.set_reason(job, "R", "between")  # event 7
        for step in range(6, 9):  # events 8-10
            store.record_step(job, step, 1.0 / step, 10.0)
        feed.notify(job)
        got, _ = feed.read(job, live[-1].seq, live[-1].status, feed.job_version(job), 60.0)
        assert [e.seq for e in got] == [6, 7, 10]  # each run of steps as its newest; the rest kept
        assert got[0].step.step == 5 and got[0].status.step == 5 and got[-1].status.step == 8
    every = list(job_events(store.get(job), store.events(job), None))
    assert len(every) == 10  # the store and a replay keep every event
    assert conflated(every) == [e for e in every if e.seq in (1, 6, 7, 10)]


def test_a_stream_message_waits_for_the_unary_calls_in_flight_at_most_a_moment() -> None:
    calls = CallCounter(4)
    calls.add(1)
    t = time.monotonic()
    calls.wait_idle(0.2)  # a Get in flight: the stream yields for at most the bound
    assert 0.15 < time.monotonic() - t < 5
    threading.Timer(0.05, calls.add, (-1,)).start()
    t = time.monotonic()
    calls.wait_idle(10.0)  # woken as the call ends
    assert time.monotonic() - t < 5 and calls.busy == 0


def _until_closed(port: int, send: bytes) -> tuple[float, list[int]]:
    """Seconds until the server closes a raw connection that sent ``send`` and then nothing, and the
    HTTP/2 frame types it sent meanwhile (4 SETTINGS, 7 GOAWAY, 8 WINDOW_UPDATE)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(send)
        t, data = time.monotonic(), b""
        while chunk := s.recv(65536):
            data += chunk
        took, types, i = time.monotonic() - t, [], 0
    while i + 9 <= len(data):
        types.append(data[i + 3])
        i += 9 + int.from_bytes(data[i : i + 3], "big")
    return took, types


def test_a_silent_connection_and_an_idle_one_are_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sbpflow.control_plane.service import isolation

    monkeypatch.setattr(isolation, "HANDSHAKE_MS", 500)
    monkeypatch.setattr(isolation, "IDLE_MS", 5000)
    plane = start(tmp_path)
    try:
        for half in (b"", b"PRI * HTTP/2.0\r\n"):  # nothing, or half the HTTP/2 preface: a slow handshake
            took, _ = _until_closed(plane.port, half)
            assert took < 4, took  # the handshake's bound, well before the idle one
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(
            [0, 0, 0, 4, 0, 0, 0, 0, 0]
        )  # and empty SETTINGS
        took, types = _until_closed(plane.port, preface)
        assert 4 <= took < 30 and types[-1] == 7, (took, types)  # idle: GOAWAY, then closed
    finally:
        plane.stop()
