"""One client floods JobService with concurrent Gets and Lists (issue 29: 3,000 of them answered
CANCELLED in part, and a bystander's Get waited 21 s) while a bystander on the same host does Gets one
at a time. Prints the flood's answers by status code (the contract: OK or RESOURCE_EXHAUSTED, nothing
else) and the bystander's p50/p99 Get, against the same bystander on the idle server, side by side.

The server runs in this process (in-process backend, the default 64 unary threads); the flood and the
bystander are child processes of this script, each with its own channel and client id, so that neither
shares the server's GIL or the other's connection.

    python bench/control_plane/grpc_flood.py --calls 3000 --rotate
    python bench/control_plane/grpc_flood.py --quick
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sbpflow.control_plane.service.isolation import CLIENT_ID_KEY, RETRY_AFTER_KEY  # noqa: E402
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig  # noqa: E402
from sbpflow.runs.options import MANAGER_DEFAULTS  # noqa: E402
from sbpflow.v1 import service_pb2 as sp  # noqa: E402

SERVICE = "/sbpflow.v1.JobService/"


def _stubs(channel: grpc.Channel) -> tuple[grpc.UnaryUnaryMultiCallable, grpc.UnaryUnaryMultiCallable]:
    get = channel.unary_unary(
        SERVICE + "Get",
        request_serializer=sp.GetJobRequest.SerializeToString,
        response_deserializer=sp.JobStatus.FromString,
    )
    lst = channel.unary_unary(
        SERVICE + "List",
        request_serializer=sp.ListJobsRequest.SerializeToString,
        response_deserializer=sp.ListJobsResponse.FromString,
    )
    return get, lst


def flood(address: str, job_id: str, calls: int, rotate: bool, page: int) -> None:
    """``calls`` Gets and Lists (of ``page`` jobs) at once on one channel; prints the count of each status
    code (JSON)."""
    with grpc.insecure_channel(address) as channel:
        get, lst = _stubs(channel)
        grpc.channel_ready_future(channel).result(timeout=30)
        print("firing", flush=True)  # the parent starts the bystander's clock
        pending = []
        for i in range(calls):
            meta = ((CLIENT_ID_KEY, f"flood-{i if rotate else 0}"),)
            if i % 2:
                pending.append(lst.future(sp.ListJobsRequest(page_size=page), timeout=60, metadata=meta))
            else:
                pending.append(get.future(sp.GetJobRequest(job_id=job_id), timeout=60, metadata=meta))
        codes: collections.Counter[str] = collections.Counter()
        hints = 0
        for f in pending:
            e = f.exception()
            codes[(e.code() if e else grpc.StatusCode.OK).name] += 1
            hints += bool(e and any(k == RETRY_AFTER_KEY for k, _ in e.trailing_metadata() or ()))
        print(json.dumps({"codes": dict(codes), "hinted": hints}), flush=True)


def bystander(address: str, job_id: str, gets: int) -> None:
    """Gets one after another, from a line on stdin until stdin closes (at most ``gets``); prints each
    one's seconds and code (JSON)."""
    with grpc.insecure_channel(address) as channel:
        get, _ = _stubs(channel)
        get(sp.GetJobRequest(job_id=job_id), timeout=30)  # connected before the clock starts
        print("ready", flush=True)
        sys.stdin.readline()
        done = threading.Event()

        def until_closed() -> None:
            sys.stdin.read()
            done.set()

        threading.Thread(target=until_closed, daemon=True).start()
        out: list[tuple[float, str]] = []
        while len(out) < gets and not done.is_set():
            t = time.perf_counter()
            try:
                get(sp.GetJobRequest(job_id=job_id), timeout=30, metadata=((CLIENT_ID_KEY, "bystander"),))
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            out.append((time.perf_counter() - t, code))
            time.sleep(0.002)  # a client that reads its answer, not a second flood
        print(json.dumps(out), flush=True)


def _child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _bystander(common: list[str], during: Callable[[Callable[[], None]], None]) -> list[tuple[float, str]]:
    """A bystander's Gets while ``during(go)`` runs, from when it calls ``go()``."""
    by = _child("--role", "bystander", *common)
    assert by.stdin is not None and by.stdout is not None
    by.stdout.readline()  # "ready": connected

    def go() -> None:
        by.stdin.write("go\n")  # type: ignore[union-attr]
        by.stdin.flush()  # type: ignore[union-attr]

    during(go)
    return list(json.loads(by.communicate("")[0]))


def _summary(times: list[tuple[float, str]]) -> tuple[float, float, float, collections.Counter[str]]:
    ms = np.asarray([t for t, _ in times]) * 1e3
    codes = collections.Counter(c for _, c in times)
    return float(np.median(ms)), float(np.percentile(ms, 99)), float(ms.max()), codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--gets", type=int, default=5000, help="at most this many bystander Gets a phase")
    ap.add_argument("--seconds", type=float, default=3.0, help="the idle phase's length")
    ap.add_argument("--rotate", action="store_true", help="the flood gives every call a new client id")
    ap.add_argument("--rows", type=int, default=200, help="jobs in the store; every List asks for them all")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--role", choices=("flood", "bystander"), help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "flood":
        return flood(args.address, args.job, args.calls, args.rotate, args.rows)
    if args.role == "bystander":
        return bystander(args.address, args.job, args.gets)
    if args.quick:
        args.calls, args.seconds = 600, 1.0
    with tempfile.TemporaryDirectory() as tmp:
        plane = ControlPlane(
            ServerConfig(store=str(Path(tmp) / "jobs.db"), run=MANAGER_DEFAULTS.replace(backend="inprocess"),
                         slots=4, http_port=None)
        ).start()  # fmt: skip
        try:
            for i in range(args.rows):  # a List page of real rows
                plane.store.create(b"", f"job-{i}")
            job_id = plane.store.list(None, limit=1, offset=0)[0].id
            common = [
                "--address",
                plane.address,
                "--job",
                job_id,
                f"--gets={args.gets}",
                f"--rows={args.rows}",
            ]

            def idle_for(go: Callable[[], None]) -> None:
                go()
                time.sleep(args.seconds)

            idle = _bystander(common, idle_for)
            rotate = ["--rotate"] if args.rotate else []
            result: dict[str, Any] = {}

            def run_flood(go: Callable[[], None]) -> None:
                fl = _child("--role", "flood", *common, "--calls", str(args.calls), *rotate)
                assert fl.stdout is not None
                fl.stdout.readline()  # "firing"
                t0 = time.perf_counter()
                go()
                result.update(json.loads(fl.communicate("")[0]), took=time.perf_counter() - t0)

            busy = _bystander(common, run_flood)
        finally:
            plane.stop()
    print(f"flood: {args.calls} concurrent Get/List from one client{' (a new client id each)' if args.rotate else ''}"
          f" in {result['took']:.1f} s: {result['codes']}, {result['hinted']} refusals with retry-after-ms")  # fmt: skip
    (p50i, p99i, maxi, ci), (p50b, p99b, maxb, cb) = _summary(idle), _summary(busy)
    print(f"{'bystander Get':<22}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}  codes")
    print(f"{'idle server':<22}{p50i:>10.1f}{p99i:>10.1f}{maxi:>10.1f}  {dict(ci)}")
    print(f"{'during the flood':<22}{p50b:>10.1f}{p99b:>10.1f}{maxb:>10.1f}  {dict(cb)}")
    print(f"{'ratio flood/idle':<22}{p50b / p50i:>10.1f}{p99b / p99i:>10.1f}{maxb / maxi:>10.1f}")


if __name__ == "__main__":
    main()
