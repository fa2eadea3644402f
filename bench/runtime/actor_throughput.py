"""Actor throughput: empty acts per second through the engine, against the 50,000 acts/s target.

    python bench/runtime/actor_throughput.py          # every case, ~10 s on 2 cores
    python bench/runtime/actor_throughput.py --quick  # a smoke run

Every act is empty (it passes its iteration on), so what is measured is the engine alone: the act
condition, req/ack bookkeeping, the ready heap, and for actors on different streams the hand-off
between threads (a condition wake-up, under the GIL). Cases, side by side in one process:
a chain of 8 actors and a diamond (fork to 2 branches of 3, join) on one stream; the chain with
2-slot registers; the chain with the trace on; the chain spread over 2 and 3 streams, where every
register crosses threads. Each case is run ``--repeat`` times and the best is reported.

Then the engine's CPU an act *outside* the acts when they do work (a chain of 8 on one stream): empty,
a pure-Python spin of ~150 us (the engine's code and data leave the core's caches and predictors), and
a 2 MB copy (a kernel's memory traffic, as ResNet-18's convolutions make). An act's CPU is taken
inside it (thread CPU), the run's from the process; the difference is what the engine costs an act.
Measured (load ~4): ~2.7 us empty, ~5 us after the spin, ~8.5 us after the copy: the ~9 us an act
that ResNet-18 spends outside its acts (bench/models/resnet.py --trace) is mostly this cold-cache
price of the engine's bookkeeping, so what cuts it is fewer acts, not fewer Python instructions in
each. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sbpflow.actor_workers.runtime.actors import ActorSpec, RegisterSpec
from sbpflow.actor_workers.runtime.engine import Engine

TARGET = 50_000


def passes(it: int, xs: list) -> list:
    return [it]


def sink(it: int, xs: list) -> None:
    return None


def chain(n_actors: int, iters: int, count: int, streams: tuple[str, ...]) -> tuple[list, list]:
    acts = []
    for i in range(n_actors):
        last = i == n_actors - 1
        acts.append(
            ActorSpec(
                i,
                f"a{i}",
                streams[i % len(streams)],
                (i - 1,) if i else (),
                () if last else (i,),
                sink if last else passes,
                iters,
            )
        )
    regs = [RegisterSpec(i, i, (i + 1,), count) for i in range(n_actors - 1)]
    return acts, regs


def diamond(iters: int, count: int) -> tuple[list, list]:
    """0 -> (1 -> 2 -> 3) and (4 -> 5 -> 6) -> 7: a fork, two branches, a join."""
    edges = [(0, 1), (1, 2), (2, 3), (0, 4), (4, 5), (5, 6), (3, 7), (6, 7)]
    outs: dict[int, list[int]] = {i: [] for i in range(8)}
    ins: dict[int, list[int]] = {i: [] for i in range(8)}
    regs = []
    for a in range(8):  # one register per producer, read by all its successors
        succ = [b for x, b in edges if x == a]
        if succ:
            regs.append(RegisterSpec(a, a, tuple(succ), count))
            outs[a].append(a)
            for b in succ:
                ins[b].append(a)
    acts = [
        ActorSpec(i, f"d{i}", "compute", tuple(ins[i]), tuple(outs[i]), passes if outs[i] else sink, iters)
        for i in range(8)
    ]
    return acts, regs


def measure(build, repeat: int, trace: bool = False) -> float:  # type: ignore[no-untyped-def]
    best = 0.0
    for _ in range(repeat):
        acts, regs = build()
        engine = Engine(acts, regs, trace=trace)
        start = time.perf_counter()
        result = engine.run(timeout=600)
        best = max(best, result.acts / (time.perf_counter() - start))
    return best


def cold(iters: int, work: Callable[[], None]) -> float:
    """The engine's CPU seconds an act outside the acts of a chain of 8 whose acts each run ``work``."""
    inside = [0.0]

    def act(it: int, xs: list) -> list:
        t0 = time.thread_time()
        work()
        inside[0] += time.thread_time() - t0
        return [it]

    acts, regs = chain(8, iters, 1, ("compute",))
    acts = [dataclasses.replace(a, act=act) for a in acts]
    start = time.process_time()
    result = Engine(acts, regs).run(timeout=600)
    return (time.process_time() - start - inside[0]) / result.acts


def spin() -> None:
    end = time.thread_time() + 150e-6
    while time.thread_time() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=10_000, help="iterations per actor")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, repeat = (2_000, 1) if args.quick else (args.iters, args.repeat)
    cases = [
        ("chain of 8, 1 stream, count 1", lambda: chain(8, n, 1, ("compute",)), False),
        ("chain of 8, 1 stream, count 2", lambda: chain(8, n, 2, ("compute",)), False),
        ("diamond of 8, 1 stream, count 1", lambda: diamond(n, 1), False),
        ("chain of 8, 1 stream, trace on", lambda: chain(8, n, 1, ("compute",)), True),
        ("chain of 8, 2 streams, count 1", lambda: chain(8, n // 4, 1, ("compute", "comm")), False),
        ("chain of 8, 2 streams, count 2", lambda: chain(8, n // 4, 2, ("compute", "comm")), False),
        ("chain of 8, 3 streams, count 2", lambda: chain(8, n // 4, 2, ("data", "compute", "comm")), False),
    ]
    print(f"{'case':<36} {'acts/s':>10} {'vs 50,000':>10}")
    for name, build, trace in cases:
        rate = measure(build, repeat, trace)
        print(f"{name:<36} {rate:>10,.0f} {rate / TARGET:>9.2f}x")
    src, dst = np.ones(2**19, np.float32), np.empty(2**19, np.float32)
    works = [
        ("empty", lambda: None),
        ("a 150 us Python spin", spin),
        ("a 2 MB copy", lambda: np.copyto(dst, src)),
    ]
    print(f"\nengine CPU an act outside the acts (chain of 8, 1 stream, best of {repeat}):")
    for name, work in works:
        cost = min(cold(n // 8 if name != "empty" else n, work) for _ in range(repeat))
        print(f"  acts doing {name:<24} {cost * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
