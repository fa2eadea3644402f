"""Actor throughput: empty acts per second through the engine, against the 50,000 acts/s target.

    python bench/runtime/actor_throughput.py          # every case, ~10 s on 2 cores
    python bench/runtime/actor_throughput.py --quick  # a smoke run

Every act is empty (it passes its iteration on), so what is measured is the engine alone: the act
condition, req/ack bookkeeping, the ready heap, and for actors on different streams the hand-off
between threads (a condition wake-up, under the GIL). Cases, side by side in one process:
a chain of 8 actors and a diamond (fork to 2 branches of 3, join) on one stream; the chain with
2-slot registers; the chain with the trace on; the chain spread over 2 and 3 streams, where every
register crosses threads. Each case is run ``--repeat`` times and the best is reported. This is a
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

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


if __name__ == "__main__":
    main()
