"""The control plane: submit-to-first-step latency (issue 19, target <= 300 ms on warm workers; issue 6:
< 2 s) and Get queries per second against a store of 1,000 jobs (target >= 1,000/s).

    python bench/control_plane/control_plane.py                # in-process backend, 10 latency runs,
                                                               # 3 s of Gets
    python bench/control_plane/control_plane.py --backend ray  # a local Ray: cold workers, then a warm
                                                               # pool of 8
    python bench/control_plane/control_plane.py --quick        # 3 runs, 1 s of Gets

Latency: a real server on loopback (gRPC, SQLite store in a temp folder); the client submits the tiny
MLP example (2 ranks) and reads the Watch stream until the first step event; the time from calling
Submit to receiving it. The peer, measured alternately in the same process: ``sf.run`` of the same job
with an ``on_step`` listener, from the call to the first step: what the control plane adds is the
difference (validation, the store, the runner thread, the stream). The cluster is warm: one job runs
before measuring. On Ray it runs twice: a new worker process per rank per job (``--warm-workers 0``,
as before issue 19), then with a warm pool (``worker_pool.py``), where both the server and ``sf.run``
take the previous job's workers.

Gets: 1,000 finished jobs are written to the store (each with a few events and losses), then one
client calls Get on random ids for ``--seconds`` from 1 and from 4 threads. The peer: the same number
of ``JobStore.get`` calls in process (the ceiling the store sets). This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TARGET = 0.3  # s, submit-to-first-step through the control plane (issue 19, warm workers; issue 6: 2 s)


def load_mlp() -> Any:
    spec = importlib.util.spec_from_file_location("example_mlp", ROOT / "examples" / "mlp.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def via_server(client: Any, job: Any) -> float:
    t0 = time.perf_counter()
    h = client.submit(job)
    for ev in h.events():
        if ev.HasField("step"):
            first = time.perf_counter() - t0
            break
    h.wait(60)
    return first


def direct(job: Any, backend: str) -> float:
    from sbpflow.control_plane.launch.launcher import run

    first: list[float] = []
    t0 = time.perf_counter()
    run(job, backend=backend, on_step=lambda m: first.append(time.perf_counter() - t0) if not first else None)
    return first[0]


def latency(backend: str, runs: int, tmp: Path, warm_workers: int = 0) -> None:
    from sbpflow.client.client import Client
    from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
    from sbpflow.runs.options import MANAGER_DEFAULTS

    job = load_mlp().make_job(steps=3)
    cfg = ServerConfig(store=str(tmp / f"lat{warm_workers}.db"), run=MANAGER_DEFAULTS.replace(backend=backend),
                       slots=None if backend == "ray" else 4, http_port=None, warm_workers=warm_workers)  # fmt: skip
    plane = ControlPlane(
        cfg
    ).start()  # with warm workers, sf.run in this process takes them from its pool too
    try:
        with Client(plane.address) as c:
            via_server(c, job), direct(job, backend)  # warm: imports, Ray, caches (and the pool)
            server, peer = [], []
            for _ in range(runs):
                server.append(via_server(c, job))
                peer.append(direct(job, backend))
    finally:
        plane.stop()
    s, p = statistics.median(server), statistics.median(peer)
    workers = f"warm pool of {warm_workers}" if warm_workers else "a new worker per rank per job"
    print(f"submit-to-first-step ({backend}, {workers}, {runs} runs, median): control plane {s * 1e3:.1f} ms, "
          f"sf.run direct {p * 1e3:.1f} ms, added {(s - p) * 1e3:+.1f} ms, ratio {s / p:.2f}; "
          f"target < {TARGET * 1e3:.0f} ms: {'met' if s < TARGET else 'NOT met'}")  # fmt: skip


def fill(store: Any, n: int) -> list[str]:
    from sbpflow.runs.states import JobState

    ids = []
    for i in range(n):
        rec = store.create(b"\x00" * 2000, f"job{i}", total_steps=3, slots=2)
        for st in (JobState.COMPILING, JobState.STARTING, JobState.RUNNING):
            store.transition(rec.id, st)
        for step in (1, 2, 3):
            store.record_step(rec.id, step, 1.0 / step, 1000.0)
        store.transition(rec.id, JobState.SUCCEEDED)
        ids.append(rec.id)
    return ids


def gets(seconds: float, tmp: Path) -> None:
    from sbpflow.client.client import Client
    from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
    from sbpflow.runs.options import MANAGER_DEFAULTS

    plane = ControlPlane(
        ServerConfig(
            store=str(tmp / "get.db"),
            run=MANAGER_DEFAULTS.replace(backend="inprocess"),
            slots=1,
            http_port=None,
        )  # fmt: skip
    )
    plane.start()
    try:
        t = time.perf_counter()
        ids = fill(plane.store, 1000)
        print(f"store: 1,000 jobs written in {time.perf_counter() - t:.1f} s")
        n = 0
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            plane.store.get(random.choice(ids))
            n += 1
        peer = n / (time.perf_counter() - t)
        for threads in (1, 4):
            counts = [0] * threads

            def worker(k: int, c: Any, counts: list[int] = counts) -> None:
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    c.get(random.choice(ids))
                    counts[k] += 1

            clients = [Client(plane.address) for _ in range(threads)]
            for c in clients:
                c.get(ids[0])  # connect
            t = time.perf_counter()
            ts = [threading.Thread(target=worker, args=(k, c)) for k, c in enumerate(clients)]
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            qps = sum(counts) / (time.perf_counter() - t)
            for c in clients:
                c.close()
            print(f"Get over gRPC, {threads} client thread(s): {qps:,.0f}/s (JobStore.get in process: "
                  f"{peer:,.0f}/s, ratio {qps / peer:.3f}); target >= 1,000/s: "
                  f"{'met' if qps >= 1000 else 'NOT met'}")  # fmt: skip
    finally:
        plane.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("inprocess", "ray"), default="inprocess")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warm-workers", type=int, default=8, help="ray: the warm pool's size (0: cold only)")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.seconds = 3, 1.0
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="sbpflow-bench-") as tmp:
        latency(args.backend, args.runs, Path(tmp))  # ray: cold workers (before issue 19), then warm ones
        if args.backend == "ray" and args.warm_workers:
            latency(args.backend, args.runs, Path(tmp), args.warm_workers)
        gets(args.seconds, Path(tmp))


if __name__ == "__main__":
    main()
