"""What a worker's step reports and heartbeats say of its process: CPU seconds and resident memory, read
from the process itself, non-zero in a real run on the in-process backend and on Ray (each rank a worker
process of its own there)."""

from __future__ import annotations

import resource
import time

import pytest

import sbpflow as sf
from sbpflow.actor_workers.step_reports import heartbeat, process_usage
from sbpflow.v1 import service_pb2 as sp
from tests.actor_workers.test_equivalence import LAYOUTS


def test_process_usage_is_this_processes_cpu_and_resident_memory() -> None:
    cpu, rss = process_usage()
    until = time.process_time() + 0.05
    while time.process_time() < until:  # 50 ms of CPU
        pass
    later, _ = process_usage()
    assert later - cpu >= 0.05
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    # a Python process holds more than 1 MiB, and not above its peak (the kernel's peak lags a little)
    assert 1 << 20 < rss <= 1.05 * peak
    beat = heartbeat()
    assert beat.cpu_seconds >= later and beat.rss_bytes > 0


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_every_step_report_of_a_real_run_carries_its_processs_usage(
    backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "ray":
        request.getfixturevalue("ray_local")
    reports: list[sp.WorkerReport] = []
    sf.run(LAYOUTS["mlp-dp4"](), backend=backend, steps=3, on_report=reports.append, timeout=120)
    steps = [r for r in reports if r.WhichOneof("payload") == "step"]
    assert {r.rank for r in steps} == {0, 1, 2, 3} and len(steps) == 12
    for r in steps:
        assert r.step.cpu_seconds > 0 and r.step.rss_bytes > 1 << 20, r
    by_rank = {r.rank: [s.step.cpu_seconds for s in steps if s.rank == r.rank] for r in steps}
    assert all(cpu == sorted(cpu) for cpu in by_rank.values())  # a process's CPU time only grows
