"""``sbpflow_worker_up``'s hand-written lines are byte for byte what prometheus-client writes for the same
family, scrape after scrape as the workers' states and rank sets change; a scrape parses whole."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from sbpflow.control_plane.status.metrics import UP_HELP, UP_NAME, Metrics, WorkerUpLines
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.runs.states import JobState, WorkerState

STATES = list(WorkerState)
UP = (WorkerState.STARTING, WorkerState.RUNNING)


class _Family:
    def __init__(self, jobs: list[tuple[str, list[WorkerRecord]]]) -> None:
        self.jobs = jobs

    def collect(self) -> list[Metric]:
        up = GaugeMetricFamily(UP_NAME, UP_HELP, labels=["job_id", "rank"])
        for job_id, rows in self.jobs:
            for w in rows:
                up.add_metric([job_id, str(w.rank)], 1.0 if w.state in UP else 0.0)
        return [up]


def _rows(job_id: str, ranks: list[int], turn: int) -> list[WorkerRecord]:
    return [WorkerRecord(job_id, r, f"w{r}", STATES[(r + turn) % len(STATES)], "h", turn, 0.0) for r in ranks]


def test_worker_up_lines_equal_prometheus_clients_through_state_and_rank_changes() -> None:
    lines = WorkerUpLines()
    odd = 'a"b\\c\nd'  # every character the text format escapes in a label value
    scrapes = [
        [("j1", _rows("j1", list(range(6)), 0)), (odd, _rows(odd, [3, 1], 0))],
        [("j1", _rows("j1", list(range(6)), 1)), (odd, _rows(odd, [3, 1], 2))],  # states change
        [("j1", _rows("j1", [0, 2, 4], 3))],  # j1 shrank; the other job ended
        [(odd, _rows(odd, [3, 1, 7], 1)), ("j1", _rows("j1", [0, 2, 4], 4))],  # it is back, larger
        [],
    ]
    for jobs in scrapes:
        assert lines.render(jobs) == generate_latest(_Family(jobs))


def test_a_scrape_shows_every_in_flight_workers_series_and_only_those() -> None:
    store = JobStore(":memory:")
    running = store.create(b"", "big", slots=1024)
    for st in (JobState.COMPILING, JobState.STARTING, JobState.RUNNING):
        store.transition(running.id, st)
    done = store.create(b"", "small", slots=2)
    store.transition(done.id, JobState.CANCELLED)
    rows = {running.id: _rows(running.id, list(range(1024)), 0), done.id: _rows(done.id, [0, 1], 0)}
    m = Metrics(store, lambda job_id: rows[job_id])
    for turn in range(2):
        rows[running.id] = _rows(running.id, list(range(1024)), turn)
        families = {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}
        up = {(s.labels["job_id"], int(s.labels["rank"])): s.value for s in families[UP_NAME].samples}
        want = {(running.id, w.rank): float(w.state in UP) for w in rows[running.id]}
        assert up == want  # the ended job has none
        assert {s.labels["job_id"] for s in families["sbpflow_job_step"].samples} == {running.id, done.id}
        jobs = {s.labels["state"]: s.value for s in families["sbpflow_jobs"].samples}
        assert jobs["RUNNING"] == 1 and jobs["CANCELLED"] == 1
