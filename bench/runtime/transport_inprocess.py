"""In-process transport throughput: all-reduce and send/recv between 2 and 4 rank-threads, side by side
with a plain numpy copy of the same bytes in the same process.

    python bench/runtime/transport_inprocess.py          # 1 MB and 64 MB float32, 2 and 4 ranks
    python bench/runtime/transport_inprocess.py --quick  # a smoke run in seconds

Figures, per rank and call, for an array of |T| bytes:
- ``all_reduce``: |T| / time of one all-reduce (the algorithm bandwidth);
- ``send/recv``: every rank sends |T| to the next rank of a ring and receives |T| from the previous one,
  |T| / time of that exchange;
- ``numpy copy``: |T| / time of ``np.copyto`` of the same bytes into a buffer in cache/RAM already
  touched, on one thread: the ratio's denominator;
- ``numpy .copy()``: |T| / time of ``x.copy()``, which allocates: a transport that hands every caller a
  private result pays this (fresh pages fault in; above glibc's mmap threshold, every time);
- ``numpy all-reduce``: one thread summing the p arrays and copying the sum out p - 1 times (p private
  results) — what a transport without threads would do.
On a 2-core machine 4 rank-threads share 2 cores, so their figures are per rank of an oversubscribed run.
This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sbpflow.actor_workers.transport.base import Transport
from sbpflow.actor_workers.transport.inprocess import InProcessWorld

MB = 1 << 20


def per_call(fn: Callable[[], object], min_time: float) -> float:
    """Seconds per call of ``fn`` on this thread (best of three batches)."""
    fn()
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time / 3:
            fn()
            calls += 1
        best = min(best, elapsed / calls)
    return best


def spmd_per_call(ranks: int, step: Callable[[Transport, int], object], iters: int) -> float:
    """Seconds per step when every rank-thread runs ``step`` ``iters`` times in lockstep."""
    world = InProcessWorld(range(ranks), timeout=120)
    start_line = threading.Barrier(ranks + 1)
    errors: list[BaseException] = []

    def body(r: int) -> None:
        t = world.transport(r)
        try:
            step(t, -1)  # warm-up
            start_line.wait()
            for i in range(iters):
                step(t, i)
            start_line.wait()
        except BaseException as e:  # noqa: B036 - reported below
            errors.append(e)
            world.abort(repr(e))
            start_line.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(ranks)]
    for th in threads:
        th.start()
    start_line.wait()
    start = time.perf_counter()
    start_line.wait()
    elapsed = time.perf_counter() - start
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return elapsed / iters


def bench(size_bytes: int, ranks: int, min_time: float) -> dict[str, float]:
    n = size_bytes // 4
    group = tuple(range(ranks))
    inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(ranks)]
    iters = max(3, int(min_time / max(size_bytes / 2e9, 2e-5)))

    def all_reduce(t: Transport, i: int) -> object:
        return t.all_reduce(inputs[t.rank], group, f"ar{i}")

    def ring(t: Transport, i: int) -> object:
        t.send(inputs[t.rank], (t.rank + 1) % ranks, "ring")
        return t.recv((t.rank - 1) % ranks, "ring")

    dst = np.empty_like(inputs[0])

    def numpy_all_reduce() -> list[np.ndarray]:
        total = functools.reduce(np.add, inputs)
        return [total] + [total.copy() for _ in range(ranks - 1)]

    return {
        "all_reduce": size_bytes / spmd_per_call(ranks, all_reduce, iters),
        "send/recv": size_bytes / spmd_per_call(ranks, ring, iters),
        "numpy copy": size_bytes / per_call(lambda: np.copyto(dst, inputs[0]), min_time),
        "numpy .copy()": size_bytes / per_call(inputs[0].copy, min_time),
        "numpy all-reduce": size_bytes / per_call(numpy_all_reduce, min_time),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs, 1 MB and 8 MB")
    args = ap.parse_args()
    sizes = [1 * MB, 8 * MB] if args.quick else [1 * MB, 64 * MB]
    min_time = 0.2 if args.quick else 2.0
    print(f"numpy {np.__version__}, {threading.active_count()} thread(s) before the run")
    print(f"{'size':>6} {'ranks':>5} {'op':>16} {'GB/s':>8} {'/ numpy copy':>13} {'/ .copy()':>10}")
    for size in sizes:
        for ranks in (2, 4):
            r = bench(size, ranks, min_time)
            copy, alloc = r["numpy copy"], r["numpy .copy()"]
            for op, v in r.items():
                print(
                    f"{size // MB:>4}MB {ranks:>5} {op:>16} {v / 1e9:>8.2f} {v / copy:>13.2f} {v / alloc:>10.2f}"
                )


if __name__ == "__main__":
    main()
