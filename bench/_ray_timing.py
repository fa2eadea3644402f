"""Timing a job on Ray from the workers' side: seconds per step from their own step reports' times, CPU
seconds per step per worker from their processes (bench/models/gpt_step.py and bench/runtime/ddp.py share it).

Workers batch their reports (at most one call a second), so when a report reaches the driver says
nothing about when its step ended; each report carries its worker's time, and a step ends when its
last rank's does. CPU: a driver thread samples the worker processes' /proc stats every 20 ms
(rescanning the process tree each second: workers start late), interpolated at the same step ends.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import sbpflow as sf


def ray_worker_pids() -> list[int]:
    """This driver's Ray worker processes (``ray::...`` descendants)."""
    me, parent, named = os.getpid(), {}, []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read(5) == b"ray::":
                    named.append(int(pid))
        except OSError:
            continue

    def mine(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == me:
                return True
        return False

    return [p for p in named if mine(p)]


def cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) of the processes ``pids`` (0 for one that is gone)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def run_timed(job: sf.Job, warmup: int, steps: int, workers: int) -> tuple[float, float]:
    """Run ``job`` on Ray (``warmup + steps`` steps); seconds per step over the last ``steps`` and the
    workers' CPU seconds per step per worker over the same span."""
    ends: dict[int, float] = {}
    samples: list[tuple[float, float]] = []
    running = threading.Event()

    def on_report(r: Any) -> None:
        if r.WhichOneof("payload") == "step":
            t = r.time.seconds + r.time.nanos * 1e-9
            ends[r.step.step] = max(ends.get(r.step.step, t), t)

    def sample() -> None:
        pids: list[int] = []
        scanned = 0.0
        while not running.wait(0.02):
            if time.monotonic() - scanned > 1.0:
                pids, scanned = ray_worker_pids(), time.monotonic()
            samples.append((time.time(), cpu_of(pids)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        sf.run(job, backend="ray", on_report=on_report, timeout=3600)
    finally:
        running.set()
        sampler.join()
    t0, t1 = ends[warmup], ends[warmup + steps]
    # the CPU over the steps the samples cover (the last ones may end after the last sample)
    last = max(k for k, t in ends.items() if warmup < k <= warmup + steps and t <= samples[-1][0])
    cpu = (_at(samples, ends[last]) - _at(samples, t0)) / (last - warmup) / workers
    return (t1 - t0) / steps, cpu


def _at(samples: list[tuple[float, float]], t: float) -> float:
    """The sampled value at time ``t``, linear between the samples around it."""
    for (ta, va), (tb, vb) in zip(samples, samples[1:], strict=False):
        if ta <= t <= tb:
            return va + (vb - va) * (t - ta) / max(tb - ta, 1e-9)
    raise SystemExit(f"no CPU samples around t={t:.3f}; the run was too short to sample")
