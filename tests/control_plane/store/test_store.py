"""The SQLite job store: lifecycle, events, loss history, persistence, reconciliation, threads."""

from __future__ import annotations

import dataclasses
import json
import math
import sqlite3
import threading
from pathlib import Path

import pytest

from sbpflow.control_plane.store.db import StoreError, StoreUnopenable, UnknownJobError
from sbpflow.control_plane.store.job_store import (
    CANCELLED_BY_USER,
    RESTART_REASON,
    RESUMED_REASON,
    AlreadyResuming,
    IllegalTransitionError,
    JobStore,
    Resumable,
)
from sbpflow.control_plane.store.schema import SCHEMA_VERSION
from sbpflow.runs.states import JobState

S = JobState


@pytest.fixture
def store(tmp_path: Path):
    s = JobStore(tmp_path / "jobs.db")
    yield s
    s.close()


def run_to(store: JobStore, job_id: str, *states: JobState) -> None:
    for st in states:
        store.transition(job_id, st)


def test_states_match_the_proto_names() -> None:
    from sbpflow.v1 import service_pb2

    names = set(service_pb2.JobState.keys()) - {"JOB_STATE_UNSPECIFIED"}
    assert {str(s) for s in JobState} == names


def test_create_and_get(store: JobStore) -> None:
    rec = store.create(b"\x01\x02job", "mlp")
    assert rec.state == S.PENDING and rec.attempt == 1 and rec.name == "mlp"
    assert rec.job_proto == b"\x01\x02job" and rec.created > 0 and rec.step == 0 and rec.loss is None
    assert store.get(rec.id) == rec
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.state = S.RUNNING  # type: ignore[misc]
    assert store.create(b"", "other").id != rec.id


def test_unknown_job(store: JobStore) -> None:
    with pytest.raises(UnknownJobError, match="nope"):
        store.get("nope")
    with pytest.raises(UnknownJobError):
        store.transition("nope", S.COMPILING)


def test_full_lifecycle(store: JobStore) -> None:
    rec = store.create(b"x", "j")
    run_to(store, rec.id, S.COMPILING, S.STARTING, S.RUNNING)
    running = store.get(rec.id)
    assert running.state == S.RUNNING and running.started is not None and running.finished is None
    done = store.transition(rec.id, S.SUCCEEDED, message="all steps")
    assert done.state == S.SUCCEEDED and done.finished is not None and done.message == "all steps"


@pytest.mark.parametrize("at", [S.PENDING, S.COMPILING, S.STARTING, S.RUNNING])
@pytest.mark.parametrize("end", [S.FAILED, S.CANCELLED])
def test_any_non_final_state_can_fail_or_cancel(store: JobStore, at: JobState, end: JobState) -> None:
    rec = store.create(b"x", "j")
    path = [S.COMPILING, S.STARTING, S.RUNNING]
    run_to(store, rec.id, *path[: path.index(at) + 1] if at != S.PENDING else [])
    out = store.transition(rec.id, end, reason="WORKER_ERROR", message="rank 1 died")
    assert out.state == end and out.reason == "WORKER_ERROR" and out.message == "rank 1 died"


@pytest.mark.parametrize(
    "path, bad",
    [
        ([], S.RUNNING),  # skips COMPILING and STARTING
        ([], S.SUCCEEDED),
        ([S.COMPILING], S.PENDING),  # backwards
        ([S.COMPILING, S.STARTING, S.RUNNING, S.SUCCEEDED], S.FAILED),  # final
        ([S.CANCELLED], S.COMPILING),
        ([S.FAILED], S.FAILED),
    ],
)
def test_illegal_transitions_name_both_states(store: JobStore, path, bad: JobState) -> None:
    rec = store.create(b"x", "j")
    run_to(store, rec.id, *path)
    before = store.get(rec.id)
    n_events = len(store.events(rec.id))
    with pytest.raises(IllegalTransitionError) as e:
        store.transition(rec.id, bad)
    assert before.state.name in str(e.value) and bad.name in str(e.value)
    assert store.get(rec.id) == before and len(store.events(rec.id)) == n_events  # nothing half-done


def test_transition_accepts_the_proto_names(store: JobStore) -> None:
    rec = store.create(b"x", "j")
    assert store.transition(rec.id, "JOB_STATE_COMPILING").state == S.COMPILING
    with pytest.raises(ValueError):
        store.transition(rec.id, "BOGUS")


def test_events_in_order_and_resumable(store: JobStore) -> None:
    rec = store.create(b"x", "j")
    run_to(store, rec.id, S.COMPILING, S.STARTING, S.RUNNING)
    store.record_step(rec.id, 1, 2.5, 100.0)
    store.record_step(rec.id, 2, 1.5, 110.0)
    store.transition(rec.id, S.SUCCEEDED)
    ev = store.events(rec.id)
    assert [e.seq for e in ev] == list(range(1, 8))
    assert [e.kind for e in ev] == ["created", "state", "state", "state", "step", "step", "state"]
    assert [e.state for e in ev] == [
        S.PENDING,
        S.COMPILING,
        S.STARTING,
        S.RUNNING,
        S.RUNNING,
        S.RUNNING,
        S.SUCCEEDED,
    ]
    assert ev[1].data == {"from": str(S.PENDING)}
    assert ev[5].data == {"step": 2, "loss": 1.5, "samples_per_second": 110.0, "step_seconds": 0.0}
    assert [e.seq for e in store.events(rec.id, after_seq=4)] == [5, 6, 7]
    assert store.events(rec.id, after_seq=7) == []
    other = store.create(b"y", "k")  # sequences are per job
    assert [e.seq for e in store.events(other.id)] == [1]


def test_record_step_keeps_the_loss_history(store: JobStore) -> None:
    rec = store.create(b"x", "j")
    run_to(store, rec.id, S.COMPILING, S.STARTING, S.RUNNING)
    for step, loss in [(1, 3.0), (2, 2.0), (3, 1.0)]:
        store.record_step(rec.id, step, loss, 50.0 + step)
    got = store.get(rec.id)
    assert got.step == 3 and got.loss == 1.0 and got.samples_per_second == 53.0
    assert [(p.step, p.loss) for p in store.losses(rec.id)] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    store.record_step(rec.id, 2, 2.0, 52.0)  # a late duplicate does not move the job back
    assert store.get(rec.id).step == 3 and store.get(rec.id).loss == 1.0


def test_list_filters_and_pages(store: JobStore) -> None:
    ids = [store.create(b"x", f"j{i}").id for i in range(5)]
    store.transition(ids[1], S.CANCELLED)
    store.transition(ids[3], S.COMPILING)
    assert [r.id for r in store.list()] == ids[::-1]  # newest first
    assert [r.id for r in store.list(limit=2, offset=1)] == [ids[3], ids[2]]
    assert [r.id for r in store.list(states=[S.PENDING])] == [ids[4], ids[2], ids[0]]
    assert {r.id for r in store.list(states=[S.CANCELLED, "JOB_STATE_COMPILING"])} == {ids[1], ids[3]}
    assert store.list(states=[]) == []
    assert store.count() == 5 and store.count([S.PENDING]) == 3
    with pytest.raises(StoreError):
        store.list(limit=-1)


def test_survives_reopening_the_file(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as s:
        a = s.create(b"\x00proto\xff", "a")
        run_to(s, a.id, S.COMPILING, S.STARTING, S.RUNNING)
        s.record_step(a.id, 1, 0.5, 10.0)
        s.transition(a.id, S.SUCCEEDED)
        b = s.create(b"b", "b")
        before = (s.get(a.id), s.get(b.id), s.events(a.id), s.losses(a.id))
    with JobStore(path) as s:
        assert (s.get(a.id), s.get(b.id), s.events(a.id), s.losses(a.id)) == before
        s.transition(b.id, S.COMPILING)  # and keeps working: sequences continue
        assert [e.seq for e in s.events(b.id)] == [1, 2]
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


def test_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    con.close()
    with pytest.raises(StoreError, match="newer"):
        JobStore(path)


def test_reconcile_after_restart(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as s:
        pending = s.create(b"x", "pending").id
        compiling = s.create(b"x", "compiling").id
        s.transition(compiling, S.COMPILING)
        starting = s.create(b"x", "starting").id
        run_to(s, starting, S.COMPILING, S.STARTING)
        running = s.create(b"x", "running").id
        run_to(s, running, S.COMPILING, S.STARTING, S.RUNNING)
        s.record_step(running, 7, 0.25, 1.0)
        done = s.create(b"x", "done").id
        run_to(s, done, S.COMPILING, S.STARTING, S.RUNNING, S.SUCCEEDED)
    with JobStore(path) as s:  # "restart"
        fixed = s.reconcile_after_restart()
        assert {r.id for r in fixed} == {compiling, starting, running}
        for job_id, was in [(compiling, S.COMPILING), (starting, S.STARTING), (running, S.RUNNING)]:
            r = s.get(job_id)
            assert r.state == S.FAILED and r.reason == RESTART_REASON and was.name in r.message
            last = s.events(job_id)[-1]
            assert last.state == S.FAILED and last.reason == RESTART_REASON
        assert s.get(running).step == 7 and s.get(running).loss == 0.25  # history kept
        assert s.get(pending).state == S.PENDING and s.get(done).state == S.SUCCEEDED
        assert s.reconcile_after_restart() == []  # idempotent
        assert s.count() == 5  # nothing lost


def test_reconcile_resumes_the_jobs_it_is_told_can_go_on(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as s:
        saved, unsaved = s.create(b"x", "saved").id, s.create(b"x", "unsaved").id
        for job_id in (saved, unsaved):
            run_to(s, job_id, S.COMPILING, S.STARTING, S.RUNNING)
            s.record_step(job_id, 7, 0.25, 1.0)
    with JobStore(path) as s:
        asked: list[str] = []

        def resumable(rec):  # what the job manager answers from the checkpoint folders
            asked.append(rec.id)
            return Resumable(5, f"goes on from step 5 (was {rec.state.name})") if rec.id == saved else None

        fixed = {r.id: r for r in s.reconcile_after_restart(resumable)}
        assert sorted(asked) == sorted(fixed) == sorted([saved, unsaved])
        r = s.get(saved)
        assert (r.state, r.reason, r.message, r.attempt, r.step) == (
            S.PENDING, RESUMED_REASON, "goes on from step 5 (was RUNNING)", 2, 5
        )  # fmt: skip
        assert r.finished is None and r.loss == 0.25 and fixed[saved] == r
        last = s.events(saved)[-1]
        assert (last.kind, last.state, last.reason) == ("state", S.PENDING, RESUMED_REASON)
        assert last.data == {"from": "JOB_STATE_RUNNING", "attempt": 2, "step": 5}
        run_to(s, saved, S.COMPILING, S.STARTING, S.RUNNING)  # the queue runs it again
        assert s.get(unsaved).state == S.FAILED and s.get(unsaved).reason == RESTART_REASON
        assert "no checkpoint" in s.get(unsaved).message


def test_new_attempt_counts_up_from_a_state_in_flight(store: JobStore) -> None:
    job_id = store.create(b"x", "j").id
    run_to(store, job_id, S.COMPILING, S.STARTING, S.RUNNING)
    for step in (10, 11, 12):
        store.record_step(job_id, step, 0.5, 1.0)
    r = store.new_attempt(job_id, 2, S.STARTING, "WORKER_LOST", "rank 1 died; resumes from step 10", 10)
    assert [p.step for p in store.losses(job_id)] == [10]  # 11 and 12 run again: only the new ones count
    assert (r.state, r.attempt, r.step, r.reason) == (S.STARTING, 2, 10, "WORKER_LOST")
    assert store.events(job_id)[-1].data == {"from": "JOB_STATE_RUNNING", "attempt": 2, "step": 10}
    run_to(store, job_id, S.RUNNING)
    store.record_step(job_id, 11, 0.4, 1.0)
    assert (store.get(job_id).step, store.get(job_id).loss) == (11, 0.4)
    with pytest.raises(StoreError, match="on attempt 2; a new attempt is numbered above it, not 2"):
        store.new_attempt(job_id, 2, S.STARTING, "WORKER_LOST", "", 10)
    with pytest.raises(IllegalTransitionError, match="PENDING or STARTING \\(not RUNNING\\)"):
        store.new_attempt(job_id, 3, S.RUNNING, "WORKER_LOST", "", 10)
    store.transition(job_id, S.CANCELLED)
    with pytest.raises(
        IllegalTransitionError, match="is CANCELLED: a new attempt starts only for a job in flight"
    ):
        store.new_attempt(job_id, 3, S.STARTING, "WORKER_LOST", "", 10)


def test_a_resumed_job_names_the_job_and_checkpoint_it_goes_on_from(store: JobStore) -> None:
    old = store.create(b"x", "old").id
    new = store.create(b"x", "new", resumed_from=old, resume_checkpoint="/c/old/step-00000004")
    rec = store.get(new.id)
    assert (rec.resumed_from, rec.resume_checkpoint, rec.attempt) == (old, "/c/old/step-00000004", 1)
    assert store.events(new.id)[0].data == {"resumed_from": old}
    with pytest.raises(UnknownJobError, match="'gone'"):
        store.create(b"x", "new", resumed_from="gone")


V6 = "DROP INDEX jobs_live_resume; ALTER TABLE jobs DROP COLUMN cancel_requested; "  # what version 6 lacks


def test_a_version_6_store_with_two_live_resumes_of_a_job_opens_keeping_the_first(tmp_path: Path) -> None:
    path = tmp_path / "v6.db"
    with JobStore(path) as s:
        old = s.create(b"x", "old").id
        first = s.create(b"x", "r1", resumed_from=old, resume_checkpoint="/c/old/step-00000004").id
    con = sqlite3.connect(path)  # version 6 let a second live job resume the same one
    con.executescript(
        f"{V6}INSERT INTO jobs (id, name, state, created, updated, job_proto, resumed_from) "
        f"VALUES ('second', 'r2', 'JOB_STATE_RUNNING', 1, 1, x'', '{old}'); PRAGMA user_version=6;"
    )
    con.commit()
    con.close()
    with JobStore(path) as s:
        assert s.get(first).state == S.PENDING
        dup = s.get("second")
        assert (dup.state, dup.reason) == (S.FAILED, "DUPLICATE_RESUME") and old in dup.message
        assert dup.finished is not None and dup.finished > 1e9  # a unix time, as the store writes them
        with pytest.raises(AlreadyResuming):  # the index holds from now on
            s.create(b"x", "r3", resumed_from=old, resume_checkpoint="/c/old/step-00000004")


def test_a_version_2_store_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    with JobStore(path) as s:
        job_id = s.create(b"x", "j").id
    con = sqlite3.connect(path)  # make it what version 2 wrote: no resume columns
    con.executescript(
        f"{V6}ALTER TABLE jobs DROP COLUMN resumed_from; ALTER TABLE jobs DROP COLUMN resume_checkpoint; "
        "ALTER TABLE jobs DROP COLUMN loss_nan; ALTER TABLE jobs DROP COLUMN eval_step; "
        "ALTER TABLE jobs DROP COLUMN eval_loss; ALTER TABLE jobs DROP COLUMN options; PRAGMA user_version=2;"
    )
    con.commit()
    con.close()
    with JobStore(path) as s:
        rec = s.get(job_id)
        assert (rec.resumed_from, rec.resume_checkpoint) == ("", "")
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7


def test_a_version_3_store_is_migrated_and_then_keeps_nan_losses(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    with JobStore(path) as s:
        job_id = s.create(b"x", "j").id
        run_to(s, job_id, S.COMPILING, S.STARTING, S.RUNNING)
        s.record_step(job_id, 1, 0.5, 10.0)
    con = sqlite3.connect(path)  # what version 3 wrote: a NOT NULL loss, no loss_nan
    con.executescript(
        f"{V6}ALTER TABLE jobs DROP COLUMN loss_nan; ALTER TABLE jobs DROP COLUMN eval_step; "
        "ALTER TABLE jobs DROP COLUMN eval_loss; ALTER TABLE jobs DROP COLUMN options; "
        "ALTER TABLE losses RENAME TO old; "
        "CREATE TABLE losses (job_id TEXT NOT NULL REFERENCES jobs(id), step INTEGER NOT NULL, "
        "loss REAL NOT NULL, samples_per_second REAL NOT NULL, time REAL NOT NULL, PRIMARY KEY (job_id, step)); "
        "INSERT INTO losses SELECT * FROM old; DROP TABLE old; PRAGMA user_version=3;"
    )
    con.commit()
    con.close()
    with JobStore(path) as s:
        assert [p.loss for p in s.losses(job_id)] == [0.5]
        s.record_step(job_id, 2, math.nan, 10.0)
        assert math.isnan(s.losses(job_id)[1].loss) and math.isnan(s.get(job_id).loss or 0.0)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_losses_round_trip_through_the_store_status_and_json(
    store: JobStore, value: float
) -> None:
    from sbpflow.control_plane.status import records

    rec = store.create(b"x", "diverges")
    run_to(store, rec.id, S.COMPILING, S.STARTING, S.RUNNING)
    store.record_step(rec.id, 1, 2.0, 10.0)
    store.record_step(rec.id, 2, value, 10.0)
    got = store.get(rec.id)
    assert got.step == 2 and got.loss is not None and repr(got.loss) == repr(value)
    assert [repr(p.loss) for p in store.losses(rec.id)] == ["2.0", repr(value)]
    events = [e for e in store.events(rec.id) if e.kind == "step"]
    assert repr(events[-1].data["loss"]) == repr(value)
    st = records.job_status(got)
    assert st.HasField("loss") and repr(st.loss) == repr(value)
    spelled = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[repr(value)]
    text = json.dumps(records.as_json(st), allow_nan=False)  # valid JSON: no bare NaN
    assert json.loads(text)["loss"] == spelled == records.json_float(value)
    msgs = list(records.job_events(got, store.events(rec.id)))
    assert repr(msgs[-1].step.loss) == repr(value) and repr(msgs[-1].status.loss) == repr(value)
    assert [r.id for r in store.list()] == [rec.id]  # List still works


def test_concurrent_writers_from_threads(store: JobStore) -> None:
    errors: list[BaseException] = []
    created: list[str] = []
    guard = threading.Lock()

    def worker(k: int) -> None:
        try:
            for i in range(10):
                rec = store.create(b"x", f"t{k}-{i}")
                run_to(store, rec.id, S.COMPILING, S.STARTING, S.RUNNING)
                for step in range(1, 4):
                    store.record_step(rec.id, step, 1.0 / step, 5.0)
                store.transition(rec.id, S.SUCCEEDED)
                with guard:
                    created.append(rec.id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(created) == 80 and store.count([S.SUCCEEDED]) == 80
    for job_id in created[::9]:
        assert [e.seq for e in store.events(job_id)] == list(range(1, 9))
        assert len(store.losses(job_id)) == 3


def test_contended_transitions_allow_exactly_one_winner(store: JobStore) -> None:
    rec = store.create(b"x", "j")
    wins: list[JobState] = []
    barrier = threading.Barrier(6)

    def go(target: JobState) -> None:
        barrier.wait()
        try:
            store.transition(rec.id, target)
            wins.append(target)
        except IllegalTransitionError:
            pass

    threads = [threading.Thread(target=go, args=(t,)) for t in [S.CANCELLED, S.FAILED] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and store.get(rec.id).state == wins[0]


def test_idempotency_key_returns_the_first_job(store: JobStore) -> None:
    a = store.create(b"j", "a", client_id="me", idempotency_key="k", total_steps=5, slots=2)
    assert store.create(b"other", "b", client_id="me", idempotency_key="k") == a
    assert store.create(b"j", "c", client_id="you", idempotency_key="k").id != a.id
    assert a.total_steps == 5 and a.slots == 2 and a.client_id == "me" and store.count() == 2


def test_set_reason_keeps_the_state_and_logs_once(store: JobStore) -> None:
    rec = store.create(b"", "j")
    store.set_reason(rec.id, "WAITING_FOR_RESOURCES", "needs 4")
    store.set_reason(rec.id, "WAITING_FOR_RESOURCES", "needs 4")
    out = store.get(rec.id)
    assert out.state == S.PENDING and out.reason == "WAITING_FOR_RESOURCES" and out.message == "needs 4"
    assert [e.kind for e in store.events(rec.id)] == ["created", "reason"]


def test_workers_logs_and_results(store: JobStore) -> None:
    from sbpflow.control_plane.store.schema import WorkerRecord
    from sbpflow.runs.states import WorkerState

    rec = store.create(b"", "j")
    for rank in (1, 0):
        store.upsert_worker(WorkerRecord(rec.id, rank, f"w{rank}", WorkerState.RUNNING, "h", 3, 1.0))
    store.upsert_worker(WorkerRecord(rec.id, 1, "w1", WorkerState.DONE, "h", 4, 2.0, 1.5, 123 << 20))
    assert [(w.rank, w.state, w.step, w.cpu_seconds, w.rss_bytes) for w in store.workers(rec.id)] == [
        (0, WorkerState.RUNNING, 3, 0.0, 0),
        (1, WorkerState.DONE, 4, 1.5, 123 << 20),  # the process's usage stays after the job
    ]
    assert [store.append_log(rec.id, r, "INFO", f"line {r}") for r in (-1, 0, 1)] == [1, 2, 3]
    assert [line.text for line in store.logs(rec.id, rank=0)] == ["line 0"]
    assert [line.seq for line in store.logs(rec.id, after_seq=1)] == [2, 3]
    assert store.result(rec.id) is None
    store.save_result(rec.id, b"result")
    assert store.result(rec.id) == b"result"
    with pytest.raises(UnknownJobError):
        store.append_log("nope", 0, "INFO", "x")


class _CommitFails:
    """The store's connection with a COMMIT that fails as on a full disk (the write itself went in)."""

    def __init__(self, real: sqlite3.Connection) -> None:
        self.real = real

    def execute(self, sql: str, *a: object) -> object:
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self.real.execute(sql, *a)


def test_a_failed_commit_is_rolled_back_and_the_store_writes_again(store: JobStore) -> None:
    from sbpflow.control_plane.store.db import StoreUnavailable

    rec = store.create(b"", "j")
    real = store._db
    store._db = _CommitFails(real)  # type: ignore[assignment]
    with pytest.raises(StoreUnavailable, match="disk is full"):
        store.append_log(rec.id, -1, "INFO", "lost")
    assert not real.in_transaction and store.write_error
    store._db = real  # the disk has room again: the next write goes (no transaction left open)
    store.append_log(rec.id, -1, "INFO", "kept")
    assert [line.text for line in store.logs(rec.id)] == ["kept"] and store.write_error == ""


def test_a_stored_cancel_ends_the_job_cancelled_after_a_restart_never_resumed(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as s:
        running, queued, other = (s.create(b"x", n).id for n in ("running", "queued", "other"))
        for job_id in (running, other):
            run_to(s, job_id, S.COMPILING, S.STARTING, S.RUNNING)
        assert s.request_cancel(running, "not needed").cancel_requested == "not needed"
        assert s.request_cancel(running, "again").cancel_requested == "not needed"  # the first one stands
        s.request_cancel(queued, "also not")
        done = s.create(b"x", "done").id
        run_to(s, done, S.COMPILING, S.STARTING, S.RUNNING, S.SUCCEEDED)
        assert s.request_cancel(done, "too late").cancel_requested == ""  # an ended job is left as it is
    with JobStore(path) as s:  # "restart"; every job could resume from a checkpoint
        fixed = s.reconcile_after_restart(lambda rec: Resumable(1, "goes on"))
        assert {r.id: r.state for r in fixed} == {running: S.CANCELLED, queued: S.CANCELLED, other: S.PENDING}
        for job_id, message in ((running, "not needed"), (queued, "also not")):
            rec = s.get(job_id)
            assert (rec.reason, rec.message, rec.attempt) == (CANCELLED_BY_USER, message, 1)
        assert s.get(done).state == S.SUCCEEDED and s.reconcile_after_restart() == []


def test_one_job_in_flight_at_most_resumes_a_job(store: JobStore) -> None:
    old = store.create(b"x", "old").id
    first = store.create(b"x", "r1", resumed_from=old, resume_checkpoint="/c/old/step-00000004").id
    with pytest.raises(
        AlreadyResuming, match=f"job {old} is already being resumed by job {first} \\(PENDING\\)"
    ):
        store.create(b"x", "r2", resumed_from=old, resume_checkpoint="/c/old/step-00000004")
    assert store.count() == 2 and store.write_error == ""  # nothing stored; the store is fine
    with pytest.raises(sqlite3.IntegrityError):  # the index holds it even for a writer that did not check
        store._db.execute(
            "INSERT INTO jobs (id, name, state, created, updated, job_proto, resumed_from) "
            "VALUES ('x2', 'r2', 'JOB_STATE_PENDING', 0, 0, x'', ?)",
            (old,),
        )
    store.transition(first, S.CANCELLED)  # once it ended, the job may be resumed again
    again = store.create(b"x", "r3", resumed_from=old, resume_checkpoint="/c/old/step-00000004")
    assert again.state == S.PENDING and again.resumed_from == old


def test_concurrent_resumes_of_one_job_store_one(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as s:
        old = s.create(b"x", "old").id
    stores = [JobStore(path) for _ in range(6)]  # six connections: as if six processes
    barrier, made, refused = threading.Barrier(len(stores)), [], []

    def resume(s: JobStore) -> None:
        barrier.wait()
        try:
            made.append(s.create(b"x", "r", resumed_from=old, resume_checkpoint="/c").id)
        except AlreadyResuming as e:
            refused.append(str(e))

    threads = [threading.Thread(target=resume, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in stores:
        s.close()
    assert len(made) == 1 and len(refused) == 5 and all(made[0] in r for r in refused), (made, refused)


@pytest.mark.parametrize(
    "broken, says",
    [
        (
            "garbage",
            "is damaged or not a job store (SQLite: file is not a database); restore it from a backup",
        ),
        ("truncated", "is damaged or not a job store (SQLite: database disk image is malformed)"),
        ("directory", "is a directory; point --store at a file in it"),
        ("no folder", "does not exist; create it or point --store at another file"),
    ],
)
def test_a_broken_store_file_is_refused_saying_what_to_do(tmp_path: Path, broken: str, says: str) -> None:
    path = tmp_path / "jobs.db"
    with JobStore(path) as s:
        for _ in range(200):
            s.create(b"x" * 500, "j")
    whole = path.read_bytes()
    for extra in (tmp_path / "jobs.db-wal", tmp_path / "jobs.db-shm"):
        extra.unlink(missing_ok=True)
    if broken == "garbage":
        path.write_bytes(bytes(range(256)) * 40)
    elif broken == "truncated":
        path.write_bytes(whole[: len(whole) * 2 // 3])
    elif broken == "directory":
        path.unlink()
        path.mkdir()
    else:
        path = tmp_path / "gone" / "jobs.db"
    with pytest.raises(StoreUnopenable) as e:
        JobStore(path)
    assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
