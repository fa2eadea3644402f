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
| ``sbpflow_worker_up`` | job_id, rank | 1 while the worker is starting or running, else 0 |
| ``sbpflow_compile_seconds`` | | time from COMPILING to STARTING |
| ``sbpflow_step_seconds`` | | wall time of each step |
| ``sbpflow_jobs_finished_total`` | state | jobs that ended, by terminal state |

Per-job series cover the jobs in flight (the ``MAX_JOBS`` newest) and, for ``EXPIRE_SECONDS``
after it ended, each ended one among the ``RECENT`` newest: a job's series expire once it has ended.
Labels are bounded: the job id, and the job's name cut to ``MAX_NAME`` characters (names are user
strings), so ``/metrics`` stays bounded on a long-lived server whatever jobs were submitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sbpflow.control_plane.store.job_store import JobStore
from sbpflow.control_plane.store.schema import WorkerRecord
from sbpflow.run_state import IN_FLIGHT, JobState, WorkerState

RECENT = 50
EXPIRE_SECONDS = 300.0  # an ended job's series stay this long
MAX_JOBS = 1000  # in-flight jobs with series
MAX_NAME = 64  # characters of a job's name in its label
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_UP = frozenset({WorkerState.STARTING, WorkerState.RUNNING})
_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COMPILE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _StoreCollector(Collector):
    def __init__(self, store: JobStore, workers: Callable[[str], Sequence[WorkerRecord]]) -> None:
        self._store, self._workers = store, workers

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
        up = GaugeMetricFamily(
            "sbpflow_worker_up", "1 while a worker starts or runs", labels=["job_id", "rank"]
        )
        held_out = GaugeMetricFamily(
            "sbpflow_job_eval_loss", "Held-out loss of a job's latest evaluation", labels=labels
        )
        since = time.time() - EXPIRE_SECONDS
        recs = {r.id: r for r in self._store.list(limit=RECENT) if (r.finished or r.updated) >= since}
        recs.update((r.id, r) for r in self._store.list(IN_FLIGHT, limit=MAX_JOBS))
        for r in recs.values():
            key = [r.id, r.name[:MAX_NAME]]
            step.add_metric(key, r.step)
            if r.loss is not None:
                loss.add_metric(key, r.loss)
            sps.add_metric(key, r.samples_per_second or 0.0)
            attempt.add_metric(key, r.attempt)
            if r.eval_step > 0 and r.eval_loss is not None:
                held_out.add_metric(key, r.eval_loss)
            if r.state in IN_FLIGHT:
                for w in self._workers(r.id):
                    up.add_metric([r.id, str(w.rank)], 1.0 if w.state in _UP else 0.0)
        yield from (step, loss, sps, attempt, up, held_out)


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
        self.registry.register(_StoreCollector(store, workers))

    def finished(self, state: JobState) -> None:
        self._finished.labels(state.name).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
