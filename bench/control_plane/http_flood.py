"""The HTTP status endpoint under a slow-connection flood (issue 29): server threads and RSS, and what a
bystander's authorized ``GET /v1/jobs`` costs, idle and beside 1,000 slow connections; the new server
(asyncio + h11, ``control_plane/status/http_server.py``) and, with ``--old``, the one before it
(``ThreadingHTTPServer``, one thread per socket, loaded from git at OLD_COMMIT).

    python bench/control_plane/http_flood.py            # new server: 1,000 slow connections, 15 s
    python bench/control_plane/http_flood.py --quick    # 300 connections, 6 s
    python bench/control_plane/http_flood.py --quick --old   # and the old server, side by side

(The old server listens with a backlog of 5 and starts a thread per accept: opening 1,000 connections to
it takes minutes of SYN retries on a loaded machine, hence ``--quick`` beside ``--old``.)

The server runs in a child process (a control plane with a token and 100 finished jobs in its store),
so its threads and RSS are its own (``/proc/PID/status``). The flood: each connection sends a request
line, then one byte a second of a header that never ends; a connection the server closes (the new
one's 10 s head deadline) is opened again at once, so the flood stays ``--conns`` strong. The
bystander: one thread, a new connection per GET of ``/v1/jobs`` with the token, for ``--seconds``;
its p50/p99 idle and under the flood. Throughput: 4 client threads GETting ``/v1/jobs`` for 3 s on an
idle server. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import http.client
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OLD_COMMIT = "9e93600"  # the last commit with the ThreadingHTTPServer endpoint
TOKEN = "bench-token"

SERVER = """
import importlib.util, pathlib, subprocess, sys, tempfile
sys.path.insert(0, {root!r})
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig
from sbpflow.runs.options import MANAGER_DEFAULTS
from sbpflow.runs.states import JobState
tmp = pathlib.Path(tempfile.mkdtemp())
plane = ControlPlane(ServerConfig(store=str(tmp / "jobs.db"), run=MANAGER_DEFAULTS.replace(backend="inprocess"),
                                  slots=1, auth_token={token!r})).start()
for i in range(100):
    rec = plane.store.create(b"\\x00" * 2000, f"job{{i}}", total_steps=3, slots=2)
    for st in (JobState.COMPILING, JobState.STARTING, JobState.RUNNING):
        plane.store.transition(rec.id, st)
    for step in (1, 2, 3):
        plane.store.record_step(rec.id, step, 1.0 / step, 1000.0)
    plane.store.transition(rec.id, JobState.SUCCEEDED)
port = plane.http_port
if {old!r}:
    src = subprocess.run(["git", "show", "{commit}:control_plane/status/http.py"], cwd={root!r},
                         capture_output=True, text=True, check=True).stdout
    path = tmp / "old_http.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_http", path)
    mod = sys.modules["old_http"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    port = mod.StatusEndpoint(plane.manager, plane.check).start()
print(port, flush=True)
sys.stdin.read()
"""


def status(pid: int) -> tuple[int, float]:
    """The process's threads and RSS (MiB)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


def get(port: int) -> float:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
    r = conn.getresponse()
    r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"GET /v1/jobs answered {r.status}")
    return time.perf_counter() - t0


def bystander(port: int, seconds: float) -> list[float]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            out.append(get(port))
        except (OSError, RuntimeError):
            out.append(float("inf"))  # refused or dropped: counted as a failure, not a latency
        time.sleep(0.01)
    return out


def throughput(port: int, seconds: float = 3.0, threads: int = 4) -> float:
    counts = [0] * threads
    end = time.monotonic() + seconds

    def run(i: int) -> None:
        while time.monotonic() < end:
            get(port)
            counts[i] += 1

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(counts) / seconds


class Flood:
    """``n`` connections sending a byte a second of a head that never ends; reopened when cut."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.cut, self.stop = port, 0, threading.Event()
        self.socks = [self._open() for _ in range(n)]
        self.thread = threading.Thread(target=self._drip, daemon=True)

    def _open(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        s.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        return s

    def _drip(self) -> None:
        while not self.stop.wait(1.0):
            for i, s in enumerate(self.socks):
                try:
                    s.sendall(b"a")
                except OSError:  # the server cut it: a real attacker opens another
                    s.close()
                    self.cut += 1
                    try:
                        self.socks[i] = self._open()
                    except OSError:
                        pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def pct(xs: list[float], q: float) -> str:
    ok = sorted(x for x in xs if x != float("inf"))
    if not ok:
        return "-"
    return f"{ok[min(len(ok) - 1, int(q * len(ok)))] * 1e3:.1f} ms"


def measure(old: bool, conns: int, seconds: float) -> dict[str, str]:
    code = SERVER.format(root=str(ROOT), token=TOKEN, old=old, commit=OLD_COMMIT)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the old server prints a traceback for every connection cut
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        get(port)
        threads0, rss0 = status(child.pid)
        idle = bystander(port, seconds / 3)
        qps = throughput(port)
        print(f"{'old' if old else 'new'}: idle measured, opening the flood", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        flood = Flood(port, conns)
        flood.thread.start()
        opened = time.monotonic() - t0
        peak_threads, peak_rss = status(child.pid)
        samples: list[float] = []
        sampler = threading.Thread(target=lambda: samples.extend(bystander(port, seconds)))
        sampler.start()
        while sampler.is_alive():
            t, r = status(child.pid)
            peak_threads, peak_rss = max(peak_threads, t), max(peak_rss, r)
            time.sleep(0.5)
        print("closing the flood", file=sys.stderr, flush=True)
        flood.close()
        failed = sum(x == float("inf") for x in samples)
        return {
            "server": "old (ThreadingHTTPServer)" if old else "new (asyncio + h11)",
            "threads idle -> flood": f"{threads0} -> {peak_threads}",
            "RSS idle -> flood": f"{rss0:.0f} -> {peak_rss:.0f} MiB",
            "/v1/jobs idle p50 / p99": f"{pct(idle, 0.5)} / {pct(idle, 0.99)}",
            "/v1/jobs flood p50 / p99": f"{pct(samples, 0.5)} / {pct(samples, 0.99)}",
            "bystander GETs failed": f"{failed} of {len(samples)}",
            "slow connections cut": str(flood.cut),
            "seconds to open the flood": f"{opened:.1f}",
            "/v1/jobs throughput (4 threads, idle)": f"{qps:,.0f}/s",
        }
    finally:
        child.kill()
        child.communicate(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", action="store_true", help="also the old ThreadingHTTPServer endpoint")
    ap.add_argument("--quick", action="store_true", help="300 connections, 6 s")
    ap.add_argument("--conns", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=15.0, help="of the bystander under the flood")
    args = ap.parse_args()
    conns, seconds = (300, 6.0) if args.quick else (args.conns, args.seconds)
    rows = [measure(False, conns, seconds)] + ([measure(True, conns, seconds)] if args.old else [])

    print(f"{conns} slow connections, bystander {seconds:g} s")
    for key in rows[0]:
        print(f"{key:40s}" + "".join(f"{r[key]:>32s}" for r in rows))


if __name__ == "__main__":
    main()
