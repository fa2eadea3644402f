"""The worker's Reporter against a real WorkerService (a ReportHub on loopback): reports that come faster
than one batch per BATCH_SECONDS go together in one ReportBatch call, in order, and all arrive; the
first goes at once, and ``done`` or a flushed report sends the queue at once; a batch is checked like single reports (credential,
attempt); a cancel in the ack reaches ``on_cancel``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from sbpflow.actor_workers import report_sender as reporting
from sbpflow.actor_workers.report_sender import Reporter
from sbpflow.actor_workers.step_reports import step_report
from sbpflow.control_plane.launch.report_hub import ReportHub
from sbpflow.v1 import service_pb2 as sp


@pytest.fixture
def hub() -> Iterator[ReportHub]:
    h = ReportHub()
    h.serve()
    yield h
    h.stop()


def until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_fast_reports_are_batched_in_order_and_the_first_and_done_go_at_once(hub: ReportHub) -> None:
    got: list[sp.WorkerReport] = []
    arrived: list[float] = []
    lock = threading.Lock()

    def on(r: sp.WorkerReport) -> None:
        with lock:
            got.append(r)
            arrived.append(time.monotonic())

    with hub.listen("j", 1, on, [0]) as credential:
        rep = Reporter(hub.address, "j", 1, 0, "w0", credential)
        t0 = time.monotonic()
        rep.send(step=step_report(0, 1.0, 0.01))
        until(lambda: len(got) == 1)
        assert arrived[0] - t0 < reporting.BATCH_SECONDS  # not held back
        for s in range(1, 300):
            rep.send(step=step_report(s, 1.0 / (s + 1), 0.001))
        until(lambda: len(got) == 300)
        assert [r.step.step for r in got] == list(range(1, 301))
        assert rep.calls <= 4, rep.calls  # 299 reports in a few batches, not 299 calls
        t1 = time.monotonic()
        rep.send(done=sp.Done())
        until(lambda: len(got) == 301)
        assert arrived[-1] - t1 < reporting.BATCH_SECONDS and got[-1].WhichOneof("payload") == "done"
        rep.close()
    assert rep.sent == 301


def test_a_flushed_report_goes_at_once_with_everything_queued_before_it(
    hub: ReportHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reporting, "BATCH_SECONDS", 60.0)  # unflushed reports would wait a minute
    got: list[int] = []
    with hub.listen("j", 1, lambda r: got.append(r.step.step), [0]) as credential:
        rep = Reporter(hub.address, "j", 1, 0, "w0", credential)
        rep.send(step=step_report(0, 1.0, 0.01))  # the first goes at once
        until(lambda: got == [1])
        for s in range(1, 5):
            rep.send(step=step_report(s, 1.0, 0.01))  # held for the batch
        rep.send(True, step=step_report(5, 1.0, 0.01))  # a checkpoint step's: flushes the queue
        until(lambda: got == [1, 2, 3, 4, 5, 6])
        rep.send(step=step_report(6, 1.0, 0.01))
        time.sleep(0.3)
        assert got == [1, 2, 3, 4, 5, 6]  # held again: a flush is not a batch that opens the window
        rep.close()
    assert got == [1, 2, 3, 4, 5, 6, 7] and rep.calls == 3


def test_reports_held_for_a_batch_do_not_wake_the_reporter_and_done_sends_them_in_order(
    hub: ReportHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a batch's wait a step report only queues (no wake-up of the thread a step); ``done`` ends
    the wait and everything goes, in order."""
    monkeypatch.setattr(reporting, "BATCH_SECONDS", 60.0)
    got: list[str] = []
    with hub.listen("j", 1, lambda r: got.append(r.WhichOneof("payload")), [0]) as credential:
        rep = Reporter(hub.address, "j", 1, 0, "w0", credential)
        rep.send(step=step_report(0, 1.0, 0.01))  # the first goes at once
        until(lambda: got == ["step"])
        rep.send(step=step_report(1, 1.0, 0.01))  # wakes the idle loop, which then holds for the batch
        until(lambda: rep._holding)
        for s in range(2, 6):
            rep.send(step=step_report(s, 1.0, 0.01))
            assert not rep._wake.is_set()
        rep.send(done=sp.Done())
        until(lambda: len(got) == 7)
        rep.close()
    assert got == ["step"] * 6 + ["done"] and rep.calls == 2


def test_a_batch_is_checked_like_single_reports_and_a_cancel_reaches_the_worker(hub: ReportHub) -> None:
    got: list[sp.WorkerReport] = []
    cancelled: list[str] = []
    with hub.listen("k", 2, got.append, [0]):
        stray = Reporter(hub.address, "k", 2, 0, "w", "not-the-credential", cancelled.append)
        for s in range(5):
            stray.send(step=step_report(s, 1.0, 0.0))
        stray.close()
        assert got == [] and stray.sent == 0
        old = Reporter(hub.address, "k", 1, 0, "w", hub.credential("k", 1), cancelled.append)
        old.send(step=step_report(0, 1.0, 0.0))
        old.close()
        assert got == [] and cancelled and "no longer runs this attempt" in cancelled[0]
        cancelled.clear()
        hub.cancel("k")
        rep = Reporter(hub.address, "k", 2, 0, "w", hub.credential("k", 2), cancelled.append)
        for s in range(20):
            rep.send(step=step_report(s, 1.0, 0.0))
        until(lambda: bool(cancelled))
        rep.close()
        assert cancelled[0] == "the control plane cancelled the job"


def test_a_batch_sent_again_is_delivered_once_but_a_single_report_must_go_forward(hub: ReportHub) -> None:
    import grpc

    from sbpflow.actor_workers.step_reports import report
    from sbpflow.v1 import service_pb2_grpc as sg

    got: list[sp.WorkerReport] = []
    with hub.listen("b", 1, got.append, [0, 1]) as credential, grpc.insecure_channel(hub.address) as ch:
        stub, meta = sg.WorkerServiceStub(ch), (("authorization", f"Bearer {credential}"),)
        batch = sp.WorkerReports(reports=[report("b", 1, r, step=step_report(0, 1.0, 0.0)) for r in (0, 1)])
        stub.ReportBatch(batch, metadata=meta)
        stub.ReportBatch(batch, metadata=meta)  # its first call went unanswered, say
        assert [(r.rank, r.step.step) for r in got] == [(0, 1), (1, 1)]
        with pytest.raises(grpc.RpcError) as e:
            stub.Report(batch.reports[0], metadata=meta)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not go forward" in str(
            e.value.details()
        )
        bad = sp.WorkerReports(reports=[report("b", 1, 7, step=step_report(1, 1.0, 0.0))])
        with pytest.raises(grpc.RpcError) as e:
            stub.ReportBatch(bad, metadata=meta)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank 7" in str(e.value.details())
