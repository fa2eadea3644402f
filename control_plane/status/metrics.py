"""The control plane's Prometheus metrics (``/metrics``), through prometheus-client.

Each server has its own ``CollectorRegistry`` (two servers in one process, as in tests, do not
collide). Histograms are observed as things happen; the gauges are read from the store (and the job
manager's live worker rows) at scrape time, so they are never stale:

| metric | labels | what |
|---|---|---|
| ``sbpflow_jobs`` | state | jobs in each lifecycle state |
| ``sbpflow_job_step`` | job_id, name | last completed step |
| ``sbpflow_job_loss`` | job_id, name | loss of the last completed step |
| ``sbpflow_job_samples_per_second`` | job_id, name | throughput of the last step |
| ``sbpflow_job_eval_loss`` | job_id, name | held-out loss of the latest evaluation (``eval_every``) |
| ``sbpflow_job_attempt`` | job_id, name | attempt number, 1-based (grows on each restart) |
| ``sbpflow_job_skipped_steps_total`` | job_id, name | steps dynamic loss scaling skipped (an inf/NaN gradient) |
| ``sbpflow_job_loss_scale`` | job_id, name | dynamic loss scaling's scale after the last step |
| ``sbpflow_worker_up`` | job_id, rank | 1 while the worker is starting or running, else 0 |
| ``sbpflow_worker_cpu_seconds_total`` | job_id, rank | CPU seconds its process has used (a counter) |
| ``sbpflow_worker_resident_memory_bytes`` | job_id, rank | its process's resident memory (host) |
| ``sbpflow_compile_seconds`` | | time from COMPILING to STARTING |
| ``sbpflow_step_seconds`` | | wall time of each step |
| ``sbpflow_jobs_finished_total`` | state | jobs that ended, by terminal state |

Per-job series cover the jobs in flight (the ``MAX_JOBS`` newest) and, for ``EXPIRE_SECONDS``
after it ended, each ended one among the ``RECENT`` newest: a job's series expire once it has ended.
Labels are bounded: the job id, and the job's name cut to ``MAX_NAME`` characters (names are user
strings), so ``/metrics`` stays bounded on a long-lived server whatever jobs were submitted.

The ``sbpflow_worker_*`` families have a series per worker of each job in flight: a 1,024-rank job's
1,024 samples cost ~10 ms of Python through prometheus-client's families on every scrape, holding the
GIL while reports come in. Their lines are therefore written here (:class:`WorkerLines`): each job's
label text is made once per rank set and kept, and a scrape joins it with each worker's value (0 or 1,
CPU seconds and resident bytes from its latest step report or heartbeat: the same names as
prometheus-client's ``process_*`` metrics); the text is the one prometheus-client writes for the same
families (a test compares them byte for byte).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import JobRecord, WorkerRecord
from sbpflow.runs.states import IN_FLIGHT, JobState, WorkerState

RECENT = 50
EXPIRE_SECONDS = 300.0  # an ended job's series stay this long
MAX_JOBS = 1000  # in-flight jobs with series
MAX_NAME = 64  # characters of a job's name in its label
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_UP = frozenset({WorkerState.STARTING, WorkerState.RUNNING})
_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COMPILE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def shown_jobs(store: JobStore) -> list[JobRecord]:
    """The jobs with series: the in-flight ones (the ``MAX_JOBS`` newest), and the ``RECENT`` newest that
    ended in the last ``EXPIRE_SECONDS``."""
    since = time.time() - EXPIRE_SECONDS
    recs = {r.id: r for r in store.list(limit=RECENT) if (r.finished or r.updated) >= since}
    recs.update((r.id, r) for r in store.list(IN_FLIGHT, limit=MAX_JOBS))
    return list(recs.values())


class _JobGauges(Collector):
    """The store's gauges for one scrape: job counts by state, and each shown job's series."""

    def __init__(self, store: JobStore, recs: Sequence[JobRecord]) -> None:
        self._store, self._recs = store, recs

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("sbpflow_jobs", "Jobs in each lifecycle state", labels=["state"])
        for s in JobState:
            jobs.add_metric([s.name], self._store.count([s]))
        yield jobs
        labels = ["job_id", "name"]
        step = GaugeMetricFamily("sbpflow_job_step", "Last completed step of a job", labels=labels)
        loss = GaugeMetricFamily("sbpflow_job_loss", "Loss of a job's last completed step", labels=labels)
        sps = GaugeMetricFamily(
            "sbpflow_job_samples_per_second", "Throughput of a job's last step", labels=labels
        )
        attempt = GaugeMetricFamily(
            "sbpflow_job_attempt", "Attempt number of a job, 1-based; grows on each restart", labels=labels
        )
        held_out = GaugeMetricFamily(
            "sbpflow_job_eval_loss", "Held-out loss of a job's latest evaluation", labels=labels
        )
        skipped = CounterMetricFamily(
            "sbpflow_job_skipped_steps", "Steps a job's dynamic loss scaling skipped", labels=labels
        )
        scale = GaugeMetricFamily("sbpflow_job_loss_scale", "A job's dynamic loss scale", labels=labels)
        for r in self._recs:
            key = [r.id, r.name[:MAX_NAME]]
            if r.loss_scale is not None:  # only a dynamically loss-scaled job has these series
                skipped.add_metric(key, r.skipped_steps)
                scale.add_metric(key, r.loss_scale)
            step.add_metric(key, r.step)
            if r.loss is not None:
                loss.add_metric(key, r.loss)
            sps.add_metric(key, r.samples_per_second or 0.0)
            attempt.add_metric(key, r.attempt)
            if r.eval_step > 0 and r.eval_loss is not None:
                held_out.add_metric(key, r.eval_loss)
        yield from (step, loss, sps, attempt, held_out, skipped, scale)


UP_NAME, UP_HELP = "sbpflow_worker_up", "1 while a worker starts or runs"
CPU_NAME, CPU_HELP = "sbpflow_worker_cpu_seconds_total", "CPU seconds a worker's process has used"
RSS_NAME, RSS_HELP = "sbpflow_worker_resident_memory_bytes", "Resident memory of a worker's process"
_UP_VALUE = {True: b" 1.0\n", False: b" 0.0\n"}


def _label(value: str) -> str:
    """A label value as the Prometheus text format escapes it (prometheus-client's ``_escape``)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@dataclass(frozen=True)
class _WorkerFamily:
    """One per-worker family: its name, help, type and each worker's value as the sample's text."""

    name: str
    help: str
    kind: str
    value: Callable[[WorkerRecord], bytes]


WORKER_FAMILIES = (
    _WorkerFamily(UP_NAME, UP_HELP, "gauge", lambda w: _UP_VALUE[w.state in _UP]),
    _WorkerFamily(CPU_NAME, CPU_HELP, "counter", lambda w: f" {floatToGoString(w.cpu_seconds)}\n".encode()),
    _WorkerFamily(
        RSS_NAME, RSS_HELP, "gauge", lambda w: f" {floatToGoString(float(w.rss_bytes))}\n".encode()
    ),
)


class WorkerLines:
    """The per-worker families' text for the in-flight jobs: label text kept per job, values per scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # two scrapes at once share the kept label text
        # job id -> (its ranks, per family the start of each worker's line)
        self._kept: dict[str, tuple[tuple[int, ...], list[list[bytes]]]] = {}

    def render(self, jobs: Iterable[tuple[str, Sequence[WorkerRecord]]]) -> bytes:
        """Each family's text (its HELP and TYPE lines, then a sample per worker of each job, in order):
        ``sbpflow_worker_up``, then the workers' CPU seconds and resident memory."""
        kept: dict[str, tuple[tuple[int, ...], list[list[bytes]]]] = {}
        shown = []
        for job_id, rows in jobs:
            ranks = tuple(w.rank for w in rows)
            with self._lock:
                known = self._kept.get(job_id)
            if known is None or known[0] != ranks:
                job = _label(job_id)
                labels = [f'{{job_id="{job}",rank="{r}"}}' for r in ranks]
                known = (ranks, [[f"{f.name}{x}".encode() for x in labels] for f in WORKER_FAMILIES])
            kept[job_id] = known
            shown.append((rows, known[1]))
        with self._lock:
            self._kept = kept  # only the jobs shown now: an ended job's text goes
        out = []
        for i, f in enumerate(WORKER_FAMILIES):
            out.append(f"# HELP {f.name} {f.help}\n# TYPE {f.name} {f.kind}\n".encode())
            for rows, starts in shown:
                out += [start + f.value(w) for start, w in zip(starts[i], rows, strict=True)]
        return b"".join(out)


class Metrics:
    """One server's metrics: observe with ``compile_seconds``/``step_seconds``/``finished``; scrape with
    ``exposition()``."""

    def __init__(self, store: JobStore, workers: Callable[[str], Sequence[WorkerRecord]]) -> None:
        self.registry = CollectorRegistry()
        self.compile_seconds = Histogram(
            "sbpflow_compile_seconds", "Time from COMPILING to STARTING", buckets=_COMPILE_BUCKETS,
            registry=self.registry,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "sbpflow_step_seconds",
            "Wall time of a training step",
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        self._finished = Counter(
            "sbpflow_jobs_finished", "Jobs that ended, by terminal state", ["state"], registry=self.registry
        )
        self._store, self._workers = store, workers
        self._up = WorkerLines()

    def finished(self, state: JobState) -> None:
        self._finished.labels(state.name).inc()

    def exposition(self) -> bytes:
        """The scrape's text: the histograms and the counter, the store's gauges, then the workers'."""
        recs = shown_jobs(self._store)
        live = [(r.id, self._workers(r.id)) for r in recs if r.state in IN_FLIGHT]
        return (
            generate_latest(self.registry)
            + generate_latest(_JobGauges(self._store, recs))
            + self._up.render(live)
        )
