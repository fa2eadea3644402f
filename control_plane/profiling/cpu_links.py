"""This machine's CPU transports measured for the cost model: a latency and a bandwidth per collective.

``measure_links(budget)`` opens two ranks, as threads of this process, on each transport a CPU job
runs over, and times each collective of the boxing table on a small and on a large float32 array:

* ``inprocess``: ranks as threads (``InProcessWorld``: ``sf.run(backend="inprocess")``);
* ``shm``: ``CpuTransport`` with shared memory, as Ray workers on one host;
* ``tcp``: ``CpuTransport`` over loopback TCP, as workers on different hosts (each rank its own host id).

Each (collective, size) runs blocks of a fixed count of calls (every rank makes the same calls), the
sizes in turns, and keeps the fastest, and the two sizes are fitted to ``hops * latency + bytes / bandwidth`` with the ring's hops and
the bytes one rank sends (``cost_model.HOPS``, ``cost_model.per_rank_bytes``): the all-reduce gives the
link's own figures, the others ``LinkProfile.collectives``. On ``inprocess`` each rank's thread CPU time
a call is fitted too, to ``seconds + bytes / bandwidth`` a call (``LinkProfile.interpreter``): there
the ranks are threads of one process, so what a collective costs a step is the interpreter time every
rank spends in it, one after the other, more than its latency. Both ranks share this process's interpreter,
which makes the ``shm`` and ``tcp`` figures a little pessimistic against two processes.
The whole measurement runs ``TIMES`` times in turn, and each figure is the median of them
(:func:`median_link`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from sbpflow.actor_workers.transport.cpu.transport import CpuTransport
from sbpflow.actor_workers.transport.inprocess import InProcessWorld
from sbpflow.boxing import Collective
from sbpflow.control_plane.compiler.cost.cost_model import HOPS, LinkProfile

SMALL, LARGE = 16, 1 << 20  # float32 elements of the latency and the bandwidth calls
ROUNDS = 3  # each size's blocks of calls, the least of them kept
TIMES = 3  # each link's measurements, the median of each figure kept
GROUP = (0, 1)
P = len(GROUP)

# collective -> (one rank's call on an array of n elements, the bytes one rank sends for n elements)
Call = Callable[[Any, np.ndarray, str], object]
CALLS: dict[Collective, tuple[Call, Callable[[int], float]]] = {
    Collective.all_reduce: (lambda t, a, tag: t.all_reduce(a, GROUP, tag), lambda n: 2 * (P - 1) / P * n * 4),
    Collective.all_gather: (lambda t, a, tag: t.all_gather(a, GROUP, 0, tag), lambda n: (P - 1) * n * 4),
    Collective.reduce_scatter: (
        lambda t, a, tag: t.reduce_scatter(a, GROUP, 0, tag),
        lambda n: (P - 1) / P * n * 4,
    ),
    Collective.all_to_all: (
        lambda t, a, tag: t.all_to_all(a, GROUP, 0, 0, tag),
        lambda n: (P - 1) / P * n * 4,
    ),
    Collective.p2p: (lambda t, a, tag: _p2p(t, a, tag), lambda n: n * 4),
}


def _p2p(t: Any, a: np.ndarray, tag: str) -> object:
    return t.send(a, 1, tag) if t.rank == 0 else t.recv(0, tag)


def measure_links(budget: float, collectives: bool = True) -> dict[str, LinkProfile]:
    """Every CPU transport's :class:`LinkProfile`, each in about ``budget / 3`` seconds; ``collectives``
    False times the all-reduce alone (the link's own figures, no per-collective ones). The ``inprocess``
    link also gets each collective's interpreter seconds (``LinkProfile.interpreter``): its ranks are
    threads of one interpreter, which their calls hold in turn. Every link is measured ``TIMES`` times
    in turn, each figure the median of them (:func:`median_link`)."""
    runs = [_measure_once(budget / TIMES, collectives) for _ in range(TIMES)]
    return {name: median_link([r[name] for r in runs]) for name in runs[0]}


def _measure_once(budget: float, collectives: bool) -> dict[str, LinkProfile]:
    kinds = (Collective.all_reduce, *(k for k in CALLS if k is not Collective.all_reduce and collectives))
    out = {}
    for name, opener in OPENERS.items():
        with opener() as ts:
            fits = {k: _fit(ts, k, budget / len(OPENERS) / len(kinds)) for k in kinds}
        lat, bw = fits[Collective.all_reduce].wall
        held = {k.value: f.cpu for k, f in fits.items()} if name in ONE_INTERPRETER else {}
        by = {k.value: f.wall for k, f in fits.items() if k is not Collective.all_reduce}
        out[name] = LinkProfile(lat, bw, by, held)
    return out


def median_link(runs: Sequence[LinkProfile]) -> LinkProfile:
    """Each figure of ``runs`` (one link measured several times) its median. A measurement's figures
    move together with a spell of the threads' scheduling (a small in-process all-gather's CPU read
    11-38 us a call from one process to the next, and a start-up that met a slow spell priced every
    ZeRO and pipeline layout ~1.6x), and the median of a few measurements leaves such a spell out."""
    mid = statistics.median

    def pairs(
        of: Callable[[LinkProfile], Mapping[str, tuple[float, float]]],
    ) -> dict[str, tuple[float, float]]:
        return {k: (mid([of(r)[k][0] for r in runs]), mid([of(r)[k][1] for r in runs])) for k in of(runs[0])}

    return LinkProfile(
        mid([r.latency_s for r in runs]),
        mid([r.bytes_per_s for r in runs]),
        pairs(lambda r: r.collectives),
        pairs(lambda r: r.interpreter),
    )


ONE_INTERPRETER = frozenset({"inprocess"})  # the links whose ranks are threads of one process


@dataclass(frozen=True)
class Fit:
    """One collective on one link: (latency a hop, bandwidth) of the slower rank's wall time, and
    (seconds a call, bandwidth) of one rank's thread CPU time."""

    wall: tuple[float, float]
    cpu: tuple[float, float]


def _fit(ts: Mapping[int, Any], kind: Collective, budget: float) -> Fit:
    call, sent = CALLS[kind]
    got: dict[int, list[tuple[float, float]]] = {SMALL: [], LARGE: []}
    for _ in range(ROUNDS):  # in turns: a spell of the threads' scheduling that slows one block of calls
        for n in got:
            got[n].append(_time(ts, call, n, budget / 2 / ROUNDS))
    (small, small_cpu), (large, large_cpu) = (
        (min(w for w, _ in got[n]), min(c for _, c in got[n])) for n in (SMALL, LARGE)
    )
    grow = sent(LARGE) - sent(SMALL)
    bw, cpu_bw = grow / max(large - small, 1e-9), grow / max(large_cpu - small_cpu, 1e-9)
    latency = max(small - sent(SMALL) / bw, 1e-9) / max(HOPS[kind](P), 1)
    return Fit((latency, bw), (max(small_cpu - sent(SMALL) / cpu_bw, 1e-9), cpu_bw))


def _time(ts: Mapping[int, Any], call: Call, numel: int, budget: float) -> tuple[float, float]:
    """The slower rank's fastest of a fixed count of calls on ``numel`` float32 elements after a warm-up
    call, and the least thread CPU seconds of a rank's call (the mean of the ranks': what one rank's
    thread spends working, without the time it sleeps waiting for its peers; the least, as every figure
    of the profile: the others' load on a shared machine adds context switches and cache misses)."""
    count = max(20, min(50, int(budget / 0.002))) if numel <= SMALL else max(3, min(10, int(budget / 0.02)))
    seq = {r: 0 for r in ts}

    def rank(r: int) -> Callable[[], tuple[float, float]]:
        array = np.ones(numel, np.float32)

        def once() -> tuple[float, float]:
            seq[r] += 1
            t, c = time.perf_counter(), time.thread_time()
            call(ts[r], array, f"profile-{numel}-{seq[r]}")
            return time.perf_counter() - t, time.thread_time() - c

        def calls() -> tuple[float, float]:
            once()  # warm: a first call sets up what the later ones reuse
            got = [once() for _ in range(count)]
            return min(w for w, _ in got), min(c for _, c in got)

        return calls

    got = spmd([rank(r) for r in sorted(ts)])
    return max(w for w, _ in got), statistics.fmean(c for _, c in got)


T = TypeVar("T")


def spmd(fns: Sequence[Callable[[], T]]) -> list[T]:
    """Each of ``fns`` on a thread of its own, at once; their results, or the first error raised."""
    out: list[T | None] = [None] * len(fns)
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
    return cast(list[T], out)  # every slot filled: no thread raised


@contextmanager
def _inprocess() -> Iterator[Mapping[int, Any]]:
    with InProcessWorld(list(GROUP), timeout=30) as w:
        yield {r: w.transport(r) for r in GROUP}


@contextmanager
def _cpu(shared_memory: bool) -> Iterator[Mapping[int, Any]]:
    ts = {
        r: CpuTransport(
            r, timeout=30, shared_memory=shared_memory, host_id=None if shared_memory else f"h{r}"
        )
        for r in GROUP
    }
    try:
        endpoints = [t.endpoint for t in ts.values()]
        spmd([_connecting(t, endpoints) for t in ts.values()])
        yield ts
    finally:
        for t in ts.values():
            t.close()


def _connecting(t: CpuTransport, endpoints: Sequence[Any]) -> Callable[[], float]:
    def run() -> float:
        t.connect(endpoints, timeout=30)
        return 0.0

    return run


OPENERS: dict[str, Callable[[], Any]] = {
    "inprocess": _inprocess,
    "shm": lambda: _cpu(shared_memory=True),
    "tcp": lambda: _cpu(shared_memory=False),
}
