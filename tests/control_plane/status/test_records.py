"""A job's worker rows built in place are the rows a ``WorkerStatus`` message each with its own
``Timestamp`` gives, byte for byte: every state, odd heartbeat times, empty strings."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

from sbpflow.control_plane.status import records
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.runs.states import WorkerState
from sbpflow.v1 import service_pb2 as sp

_WORKERS = st.lists(
    st.builds(
        WorkerRecord,
        job_id=st.just("j"),
        rank=st.integers(0, 1 << 20),
        worker_id=st.text(max_size=8),
        state=st.sampled_from(list(WorkerState)),
        host=st.text(max_size=8),
        step=st.integers(0, 1 << 40),
        last_heartbeat=st.floats(-1e9, 4e9, allow_nan=False) | st.sampled_from([0.0, 1.999999999, -0.5]),
    ),
    max_size=20,
)


def _one_message_each(w: WorkerRecord) -> sp.WorkerStatus:
    ts = Timestamp()
    ts.FromNanoseconds(int(w.last_heartbeat * 1e9))
    return sp.WorkerStatus(
        rank=w.rank, worker_id=w.worker_id, state=sp.WorkerState.Value(str(w.state)), host=w.host,
        step=w.step, last_heartbeat=ts,
    )  # fmt: skip


@given(workers=_WORKERS)
def test_rows_built_in_place_equal_a_message_each(workers: list[WorkerRecord]) -> None:
    m = sp.JobStatus(job_id="j")
    records.add_workers(m, workers)
    want = sp.JobStatus(job_id="j", workers=[_one_message_each(w) for w in workers])
    assert m.SerializeToString() == want.SerializeToString()


def test_a_jobs_status_carries_its_rows_in_order() -> None:
    with JobStore(":memory:") as store:
        rec = store.create(b"", "job")
    workers = [WorkerRecord(rec.id, r, f"w{r}", WorkerState.RUNNING, "h", 3, 1.5) for r in (2, 0, 1)]
    m = records.job_status(rec, workers)
    assert [w.rank for w in m.workers] == [2, 0, 1] and m.workers[0].last_heartbeat.nanos == 500_000_000
    assert records.job_status(rec).workers == []
