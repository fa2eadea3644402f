"""The control plane under a 1,024-rank job, its workers simulated (issue 19 part 3; targets: >= 5,000
reports/s ingested, p99 Get < 50 ms, the server under one core).

    python bench/control_plane/control_plane_scale.py  # 1,024 ranks, a step every 0.2 s, 20 s
    python bench/control_plane/control_plane_scale.py --ranks 256 --seconds 5

The control plane is the product's, in this process: a real ``ControlPlane`` (gRPC JobService and
WorkerService, the SQLite store, the job manager, the HTTP endpoint with ``/metrics``), and the
scheduler's side of a run as ``run_on_ray`` has it: ``ReportHub.listen`` with the attempt's
credential, a ``StepTracker`` assembling each step's loss (``P`` over every rank) and the job's
``RunListeners`` writing the store; the job is ``adopted`` by the manager, so Get, List and /metrics
show its 1,024 live worker rows. Only the workers are simulated: ``--procs`` processes, each holding
``ranks / procs`` ranks, each rank with the product's ``Reporter`` (one batch per second at most) sending
a ``StepReport`` with its share of the loss every ``--step-seconds``.

Meanwhile a client process times Get (the job, every worker row), List (a page of 100), /metrics, and a
Watch stream's lag (now minus each step event's time). The server's CPU is this process's CPU time over
the measured window (the driver's work is the scheduler's, which runs here in the product too). The
peer for Get is the same Get of the same job once it has ended (its 1,024 worker rows from the store)
on the same server with no reports coming in.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._shared import load_example  # noqa: E402

WARMUP = 3.0  # s of reports before the window opens (every rank connected and stepping)


def worker_process(address: str, job_id: str, credential: str, ranks: list[int], world: int, args: Any,
                   start_at: float, out: Any) -> None:  # fmt: skip
    """``ranks`` of the job, each a real Reporter; every rank reports a step each ``step_seconds``."""
    from sbpflow.actor_workers.report_sender import Reporter
    from sbpflow.actor_workers.step_reports import step_report

    reporters = [Reporter(address, job_id, 1, r, f"sim-{r}", credential) for r in ranks]
    step, t = 0, start_at
    end = start_at + WARMUP + args.seconds
    while t < end:
        time.sleep(max(0.0, t - time.time()))
        loss = 1.0 / (step + 1)
        for rep in reporters:
            rep.send(step=step_report(step, loss / world, args.step_seconds))
        step, t = step + 1, t + args.step_seconds
    for rep in reporters:
        rep.close(10.0)
    out.put((sum(r.calls for r in reporters), sum(r.sent for r in reporters), step))


def percentiles(xs: list[float]) -> str:
    if not xs:
        return "none"
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return f"p50 {statistics.median(xs) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms ({len(xs)})"


def query_process(address: str, http: str, job_id: str, after: int, seconds: float, out: Any) -> None:
    """Get, List and /metrics in turn for ``seconds``, and one Watch stream's lag on a thread."""
    from sbpflow.client.client import Client, ClientError

    lat: dict[str, list[float]] = {"get": [], "list": [], "metrics": [], "watch lag": []}
    rows = 0
    with Client(address) as c:
        stop = threading.Event()

        def watch() -> None:
            try:
                for ev in c.handle(job_id).events(after):
                    if ev.HasField("step"):
                        lat["watch lag"].append(time.time() - ev.time.ToNanoseconds() / 1e9)
                    if stop.is_set():
                        return
            except ClientError:
                if not stop.is_set():
                    raise

        threading.Thread(target=watch, daemon=True).start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            rows = len(c.get(job_id).workers)
            lat["get"].append(time.perf_counter() - t)
            t = time.perf_counter()
            c.list(limit=100)
            lat["list"].append(time.perf_counter() - t)
            t = time.perf_counter()
            urllib.request.urlopen(f"{http}/metrics", timeout=30).read()
            lat["metrics"].append(time.perf_counter() - t)
        stop.set()
    out.put((lat, rows))


def get_latencies(address: str, job_id: str, seconds: float) -> list[float]:
    from sbpflow.client.client import Client

    out = []
    with Client(address) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            c.get(job_id)
            out.append(time.perf_counter() - t)
    return out


def loss_decl(job: Any, ranks: int) -> Any:
    """The job's loss as the compiler would leave it for data parallelism: a partial sum over every rank."""
    from sbpflow.placement import placement
    from sbpflow.sbp import P

    decl = job.graph.tensors[job.loss]
    return dataclasses.replace(decl, placement=placement("cpu", list(range(ranks))), sbp=(P,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--procs", type=int, default=4, help="processes simulating the workers")
    ap.add_argument("--step-seconds", type=float, default=0.2)
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    args = ap.parse_args()

    from sbpflow.codec import wire
    from sbpflow.control_plane.launch.step_tracker import StepTracker
    from sbpflow.control_plane.service.jobs import RunningJob
    from sbpflow.control_plane.service.run_listeners import RunListeners
    from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
    from sbpflow.runs.options import MANAGER_DEFAULTS
    from sbpflow.runs.states import JobState

    job = load_example("mlp").make_job(ranks=args.ranks, batch_size=2 * args.ranks, steps=10**9)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="sbpflow-scale-") as tmp:
        cfg = ServerConfig(store=str(Path(tmp) / "jobs.db"), run=MANAGER_DEFAULTS.replace(backend="inprocess"),
                           slots=args.ranks, http_port=0, worker_service=True)  # fmt: skip
        plane = ControlPlane(cfg).start()
        assert plane.hub is not None and plane.http_address is not None
        m = plane.manager
        rec = m.store.create(wire.job_to_proto(job).SerializeToString(), job.name, total_steps=10**9,
                             slots=args.ranks)  # fmt: skip
        running = RunningJob(job, args.ranks)
        listeners = RunListeners(m, rec.id, running)
        tracker = StepTracker(loss_decl(job, args.ranks), 2 * args.ranks, listeners.on_step, job=rec.id)
        ingested = [0]
        lock = threading.Lock()

        def on_report(r: Any) -> None:  # run_on_ray's listener: the tracker, then the job's listeners
            with lock:
                ingested[0] += 1
            if r.WhichOneof("payload") == "step" and r.step.losses:
                tracker.add(int(r.rank), int(r.step.step) - 1, r.step.loss)
            listeners.on_report(r)

        ranks = list(range(args.ranks))
        with m.adopted(rec.id, running), plane.hub.listen(rec.id, 1, on_report, ranks) as credential:
            for st in (JobState.COMPILING, JobState.STARTING, JobState.RUNNING):
                listeners.on_state(st)
            out = ctx.Queue()
            start_at = time.time() + 5.0  # the processes import and connect first
            share = [ranks[i :: args.procs] for i in range(args.procs)]
            procs = [ctx.Process(target=worker_process, args=(plane.hub.address, rec.id, credential, s, args.ranks,
                                                               args, start_at, out)) for s in share]  # fmt: skip
            for p in procs:
                p.start()
            time.sleep(max(0.0, start_at + WARMUP - time.time()))
            queries = ctx.Process(target=query_process,
                                  args=(plane.address, plane.http_address, rec.id, m.store.events(rec.id)[-1].seq,
                                        args.seconds, out))  # fmt: skip
            queries.start()
            n0, c0, w0 = ingested[0], time.process_time(), time.monotonic()
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            time.sleep(args.seconds)
            n1, c1, w1 = ingested[0], time.process_time(), time.monotonic()
            rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            results = [out.get(timeout=120) for _ in range(args.procs + 1)]
            for p in [*procs, queries]:
                p.join(60)
            sent_steps = max(r[2] for r in results if len(r) == 3)
            t_end = time.monotonic()  # the last calls may still wait to be delivered: let them
            while len(tracker.losses) < sent_steps and time.monotonic() - t_end < 30:
                time.sleep(0.05)
            backlog = time.monotonic() - t_end
            listeners.on_state(JobState.SUCCEEDED)
        for w in running.workers.values():  # as the manager does at a run's end
            m.store.upsert_worker(w)
        idle_get = get_latencies(plane.address, rec.id, 3.0)  # the peer: the same rows, no load
        plane.stop()
    sims = [r for r in results if len(r) == 3]
    (lat, rows), = [r for r in results if len(r) == 2]  # fmt: skip
    calls, sent, steps = sum(s[0] for s in sims), sum(s[1] for s in sims), max(s[2] for s in sims)
    rate, cpu = (n1 - n0) / (w1 - w0), (c1 - c0) / (w1 - w0)
    print(f"{args.ranks} simulated ranks in {args.procs} processes, a step every {args.step_seconds:g} s, "
          f"{args.seconds:g} s measured; {steps} steps, {sent:,} reports in {calls:,} calls "
          f"({sent / max(calls, 1):.1f} a call), {len(tracker.losses)} steps assembled "
          f"({backlog:.1f} s after the workers' last report)")  # fmt: skip
    print(f"reports ingested: {rate:,.0f}/s (target >= 5,000/s: {'met' if rate >= 5000 else 'NOT met'})")
    print(f"server CPU: {cpu:.2f} cores (target < 1: {'met' if cpu < 1 else 'NOT met'}); "
          f"max RSS {rss1 / 1024:.0f} MB (+{(rss1 - rss0) / 1024:.0f} MB over the window)")  # fmt: skip
    get99 = sorted(lat["get"])[int(0.99 * len(lat["get"]))] if lat["get"] else float("inf")
    print(f"Get ({rows} worker rows): {percentiles(lat['get'])}; idle server (peer): "
          f"{percentiles(idle_get)}; target p99 < 50 ms: {'met' if get99 < 0.05 else 'NOT met'}")  # fmt: skip
    for name in ("list", "metrics", "watch lag"):
        print(f"{name}: {percentiles(lat[name])}")


if __name__ == "__main__":
    main()
