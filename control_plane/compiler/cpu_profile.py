"""This CPU as a cost-model profile, measured: ``measure_cpu_profile(seconds)`` (``load_profile("cpu")``).

What it times, each for a share of ``seconds`` and keeping the best rate (the least disturbed run on a
shared machine):

* **GEMM** float32 and float64, numpy's BLAS on square matrices: the peak FLOP/s per dtype (bfloat16 and
  float16 run at the float32 rate: numpy has no faster path for them);
* **elementwise**: ``np.add`` into a preallocated output on arrays far larger than the caches, the three
  arrays' bytes over the time: the memory bandwidth of the roofline;
* **per-op overhead**: a small kernel's time through the runtime's own act path is what a CPU op costs
  beyond its roofline; measured here as one tiny ``np.add`` plus the bookkeeping of one act (a dict
  lookup, a queue round trip between threads), the floor of what the executor adds;
* **links**: a two-rank all-reduce of a small and of a large array on each transport this machine runs,
  fitted to ``hops * latency + bytes / bandwidth`` (``cost_model.LinkProfile``): ``inprocess`` (ranks as
  threads: ``sf.run(backend="inprocess")``), ``shm`` and ``tcp`` (``CpuTransport`` with shared memory, and
  over loopback TCP, both ranks as threads of this process: the GIL makes them a little pessimistic).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport.cpu.transport import CpuTransport
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.boxing import Collective
from sbpflow.control_plane.compiler.cost_model import HOPS, DeviceProfile, LinkProfile

SMALL, LARGE = 16, 1 << 20  # float32 elements of the latency and the bandwidth all-reduces


def _best(fn: Callable[[], object], budget: float, least: int = 3) -> float:
    """The fastest of repeated calls of ``fn`` within ``budget`` seconds (at least ``least`` calls)."""
    best, end, n = float("inf"), time.perf_counter() + budget, 0
    while n < least or time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best


def gemm_flops(dtype: Any, budget: float, n: int = 384) -> float:
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    out = np.empty_like(a)
    return 2 * n**3 / _best(lambda: np.matmul(a, a, out=out), budget)


def elementwise_bandwidth(budget: float, n: int = 1 << 23) -> float:
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    out = np.empty_like(a)
    return 3 * a.nbytes / _best(lambda: np.add(a, b, out=out), budget)


def op_overhead(budget: float) -> float:
    """A tiny kernel plus one cross-thread hand-off, as an act's floor (module docstring)."""
    a = np.ones(8, np.float32)
    box: queue.SimpleQueue[object] = queue.SimpleQueue()
    back: queue.SimpleQueue[object] = queue.SimpleQueue()

    def peer() -> None:
        while (item := box.get()) is not None:
            back.put(item)

    th = threading.Thread(target=peer, daemon=True)
    th.start()

    def act() -> None:
        box.put(np.add(a, a))
        back.get()

    try:
        return _best(act, budget, least=20)
    finally:
        box.put(None)
        th.join(timeout=5)


def fit_link(time_of: Callable[[int], float], p: int = 2) -> LinkProfile:
    """``LinkProfile`` from the times of an all-reduce of SMALL and LARGE float32 elements over ``p`` ranks."""
    hops = HOPS[Collective.all_reduce](p)
    small, large = time_of(SMALL), time_of(LARGE)
    per_rank = 2 * (p - 1) / p * LARGE * 4  # what one rank sends in a ring all-reduce
    bw = per_rank / max(large - small, 1e-9)
    return LinkProfile(latency_s=max(small, 1e-9) / hops, bytes_per_s=bw)


def _spmd(fns: Sequence[Callable[[], float]]) -> list[float]:
    out: list[float] = [0.0] * len(fns)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


def _all_reduce_time(transports: Mapping[int, Any], numel: int, budget: float) -> float:
    group = tuple(sorted(transports))
    arrays = {r: np.ones(numel, np.float32) for r in group}
    calls = {r: 0 for r in group}

    def rank(r: int) -> Callable[[], float]:
        def run() -> float:
            def once() -> None:
                calls[r] += 1
                transports[r].all_reduce(arrays[r], group, f"profile-{numel}-{calls[r]}")

            # every rank makes the same calls: a fixed count, not a time budget each rank reads alone
            return min(_timed(once) for _ in range(_count(numel, budget)))

        return run

    return max(_spmd([rank(r) for r in group]))


def _count(numel: int, budget: float) -> int:
    return max(3, min(50, int(budget / 0.002))) if numel <= SMALL else max(3, min(10, int(budget / 0.02)))


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _inprocess_link(budget: float) -> LinkProfile:
    with InProcessWorld([0, 1], timeout=30) as w:
        ts = {r: w.transport(r) for r in (0, 1)}
        return fit_link(lambda n: _all_reduce_time(ts, n, budget / 2))


def _cpu_link(budget: float, shared_memory: bool) -> LinkProfile:
    ts = {
        r: CpuTransport(
            r, timeout=30, shared_memory=shared_memory, host_id=None if shared_memory else f"h{r}"
        )
        for r in (0, 1)
    }
    try:
        endpoints = [t.endpoint for t in ts.values()]
        _spmd([_connecting(t, endpoints) for t in ts.values()])
        return fit_link(lambda n: _all_reduce_time(ts, n, budget / 2))
    finally:
        for t in ts.values():
            t.close()


def _connecting(t: CpuTransport, endpoints: Sequence[Any]) -> Callable[[], float]:
    def run() -> float:
        t.connect(endpoints, timeout=30)
        return 0.0

    return run


def measure_cpu_profile(seconds: float = 1.0) -> DeviceProfile:
    """This CPU's profile, measured in about ``seconds`` (module docstring)."""
    share = max(seconds, 0.1) / 8
    f32, f64 = gemm_flops(np.float32, share), gemm_flops(np.float64, share)
    links = {
        "inprocess": _inprocess_link(share),
        "shm": _cpu_link(share, shared_memory=True),
        "tcp": _cpu_link(share, shared_memory=False),
    }
    return DeviceProfile(
        name="cpu",
        flops_per_s={"float32": f32, "float64": f64, "bfloat16": f32, "float16": f32},
        mem_bytes_per_s=elementwise_bandwidth(share),
        links=links,
        op_overhead_s=op_overhead(share),
        memory_bytes=_memory_bytes(),
        default_link="shm",
        source=f"measured on this machine ({os.cpu_count()} CPUs) by cpu_profile.measure_cpu_profile",
    )


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
