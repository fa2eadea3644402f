"""The per-worker families' hand-written lines (``sbpflow_worker_up``, CPU seconds, resident memory) are
byte for byte what prometheus-client writes for the same families, scrape after scrape as the workers'
states, usage and rank sets change; a scrape parses whole."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from sbpflow.control_plane.status.metrics import (
    CPU_HELP,
    RSS_HELP,
    RSS_NAME,
    UP_HELP,
    UP_NAME,
    Metrics,
    WorkerLines,
)
from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.runs.states import JobState, WorkerState

STATES = list(WorkerState)
UP = (WorkerState.STARTING, WorkerState.RUNNING)


class _Family:
    def __init__(self, jobs: list[tuple[str, list[WorkerRecord]]]) -> None:
        self.jobs = jobs

    def collect(self) -> list[Metric]:
        labels = ["job_id", "rank"]
        up = GaugeMetricFamily(UP_NAME, UP_HELP, labels=labels)
        cpu = CounterMetricFamily("sbpflow_worker_cpu_seconds", CPU_HELP, labels=labels)
        rss = GaugeMetricFamily(RSS_NAME, RSS_HELP, labels=labels)
        for job_id, rows in self.jobs:
            for w in rows:
                up.add_metric([job_id, str(w.rank)], 1.0 if w.state in UP else 0.0)
                cpu.add_metric([job_id, str(w.rank)], w.cpu_seconds)
                rss.add_metric([job_id, str(w.rank)], float(w.rss_bytes))
        return [up, cpu, rss]


def _rows(job_id: str, ranks: list[int], turn: int) -> list[WorkerRecord]:
    return [
        WorkerRecord(
            job_id, r, f"w{r}", STATES[(r + turn) % len(STATES)], "h", turn, 0.0, r * 1.5 + turn / 3, r << 27
        )
        for r in ranks
    ]


def test_worker_lines_equal_prometheus_clients_through_state_usage_and_rank_changes() -> None:
    lines = WorkerLines()
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
        rss = {int(s.labels["rank"]): s.value for s in families[RSS_NAME].samples}
        assert rss == {w.rank: float(w.rss_bytes) for w in rows[running.id]}
        cpu = families["sbpflow_worker_cpu_seconds"].samples
        assert {int(s.labels["rank"]): s.value for s in cpu} == {
            w.rank: w.cpu_seconds for w in rows[running.id]
        }
        assert {s.labels["job_id"] for s in families["sbpflow_job_step"].samples} == {running.id, done.id}
        jobs = {s.labels["state"]: s.value for s in families["sbpflow_jobs"].samples}
        assert jobs["RUNNING"] == 1 and jobs["CANCELLED"] == 1
