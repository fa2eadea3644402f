"""Streams against unary calls (issue 13's isolation target: >= 500 Watch streams held while p99 Get
< 100 ms). Starts a control plane (in-process backend, 64 unary threads, the default stream limit),
opens N Watch streams on a running job, then times Gets; prints streams held, p50/p99/max Get, and
what the server did meanwhile: steps trained, job-store reads (``store.get`` + ``store.events``) and
events sent to the streams.

    python bench/control_plane/streams.py --streams 500 --gets 500
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench._shared import load_example  # noqa: E402
from sbpflow.codec import wire  # noqa: E402
from sbpflow.control_plane.service.server import ControlPlane, ServerConfig  # noqa: E402
from sbpflow.runs.options import MANAGER_DEFAULTS  # noqa: E402
from sbpflow.v1 import service_pb2 as sp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--gets", type=int, default=500)
    args = ap.parse_args()
    job = load_example("mlp").make_job(steps=100_000)
    with tempfile.TemporaryDirectory() as tmp:
        plane = ControlPlane(
            ServerConfig(store=str(Path(tmp) / "jobs.db"), run=MANAGER_DEFAULTS.replace(backend="inprocess"),
                         slots=4, http_port=None)
        ).start()  # fmt: skip
        channel = grpc.insecure_channel(plane.address)
        submit = channel.unary_unary(
            "/sbpflow.v1.JobService/Submit", response_deserializer=sp.SubmitJobResponse.FromString
        )
        job_id = submit(sp.SubmitJobRequest(job=wire.job_to_proto(job)).SerializeToString()).job_id
        watch = channel.unary_stream(
            "/sbpflow.v1.JobService/Watch",
            request_serializer=sp.WatchJobRequest.SerializeToString,
            response_deserializer=sp.JobEvent.FromString,
        )
        get = channel.unary_unary(
            "/sbpflow.v1.JobService/Get",
            request_serializer=sp.GetJobRequest.SerializeToString,
            response_deserializer=sp.JobStatus.FromString,
        )
        sent = _count_sent(plane.manager)  # before the streams: each Watch calls manager.follow once
        streams = [watch(sp.WatchJobRequest(job_id=job_id)) for _ in range(args.streams)]
        t0 = time.perf_counter()
        for s in streams:
            next(s)
        deadline = time.monotonic() + 60
        while plane.streams.open < args.streams and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"{plane.streams.open} streams held (opened in {time.perf_counter() - t0:.1f} s)")
        reads = _count_reads(plane.manager.store)
        steps0, reads0, sent0 = plane.manager.store.get(job_id).step, sum(reads.values()), sent[0]
        times = []
        for _ in range(args.gets):
            t = time.perf_counter()
            get(sp.GetJobRequest(job_id=job_id), timeout=10)
            times.append(time.perf_counter() - t)
        ms = np.asarray(times) * 1e3
        print(
            f"{args.gets} Gets while they are held: p50 {np.median(ms):.1f} ms, p99 {np.percentile(ms, 99):.1f} ms, max {ms.max():.1f} ms"
        )
        steps = plane.manager.store.get(job_id).step - steps0
        n = sum(reads.values()) - reads0
        print(
            f"meanwhile: {steps} steps trained, {n} store reads ({n / max(steps, 1):.1f} a step, Gets' "
            f"included), {sent[0] - sent0} events sent to the streams"
        )
        for s in streams:
            s.cancel()
        channel.close()
        plane.stop()


def _count_reads(store: object) -> dict[str, int]:
    """Counts of ``store.get`` and ``store.events`` calls from now on (wraps the instance's methods)."""
    counts = {"get": 0, "events": 0}
    for name in counts:
        inner = getattr(store, name)

        def counted(*args: object, _inner: object = inner, _name: str = name) -> object:
            counts[_name] += 1
            return _inner(*args)  # type: ignore[operator]

        setattr(store, name, counted)
    return counts


def _count_sent(manager: object) -> list[int]:
    """A count of the events ``manager.follow`` yields (to every Watch stream) from now on."""
    sent, inner = [0], manager.follow  # type: ignore[attr-defined]

    def counted(*args: object) -> object:
        for ev in inner(*args):
            sent[0] += 1
            yield ev

    manager.follow = counted  # type: ignore[attr-defined]
    return sent


if __name__ == "__main__":
    main()
