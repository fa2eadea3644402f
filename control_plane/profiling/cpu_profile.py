"""This CPU as a cost-model profile, measured: ``measure_cpu_profile(seconds, threads)`` (``pricing.device_profile("cpu")``).

A profile is one CPU *rank*: its rates with ``threads`` BLAS threads (1, as a Ray worker runs a CPU
rank), on a host of ``host_cores`` cores that its ranks share (``step_sim.host_bounds``). What it times,
in three rounds of a share of ``seconds`` each, keeping each figure's best (the least disturbed on a
shared machine):

* **GEMM** float32 and float64, numpy's BLAS on square matrices: the peak FLOP/s per dtype (bfloat16 and
  float16 run at the float32 rate: numpy has no faster path for them);
* **elementwise**: ``np.add`` into a preallocated output on arrays far larger than the caches, the three
  arrays' bytes over the time: the memory bandwidth of the roofline;
* **per-act overhead**: the CPU the runtime spends on an act of a tiny kernel (register hand-offs, the
  engine's bookkeeping), from a real in-process run of a chain of tiny kernels for two step counts: the
  difference of CPU time over the acts it adds (the median of five runs, not the best: see
  :func:`_cpu_a_step`); and a register's hand-off between two streams' threads, from the same chain over
  two ranks in turn (both :func:`act_overhead`);
* **data loading**: each synthetic source kind the examples read (``SyntheticSource`` ``regression``,
  ``tokens`` and ``clicks``, :data:`SOURCES`), a read of one row and of a batch, each of a step not
  read before, fitted to a cost a read and a cost a row (:func:`read_cost`): its per-row generator is
  Python, and costs far more than the bytes it makes, and a read has fixed work besides (the search
  times the job's own source the same way, on the job's batch, ``pricing.pricer``);
* **links**: each collective of the boxing table on each CPU transport, two ranks, a small and a large
  array fitted to ``hops * latency + bytes / bandwidth`` (``cpu_links.py``: ``inprocess``, ``shm``,
  ``tcp``), three times, each figure the median; on ``inprocess`` also the thread CPU a rank spends in
  a call.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sbpflow.actor_workers.runtime.threads import limited
from sbpflow.boxing import Collective
from sbpflow.control_plane.compiler.cost.cost_model import DeviceProfile
from sbpflow.control_plane.compiler.cost.stage_load import DataCost, source_key
from sbpflow.control_plane.profiling.cpu_links import measure_links
from sbpflow.data.sources import SyntheticSource
from sbpflow.dtype import DType
from sbpflow.graph import Graph, OpNode, TensorDecl
from sbpflow.job import Job, JobConfig
from sbpflow.placement import placement
from sbpflow.sbp import B
from sbpflow.tensor_meta import TensorMeta

ROUNDS = 3  # each figure's rounds, its best kept
ROWS = 128  # the batch of the profile's own sources, for their cost a row
MAX_ROWS = 1024  # the most rows a read is timed with (a source's batch, or this)


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


LONG = 124  # the act's long run, steps


def act_overhead(threads: int, p2p_s: float = 0.0, n: int = 40, runs: int = 5) -> tuple[float, float]:
    """The runtime's CPU seconds an act, and a register's hand-off between two streams' threads.

    An act: one rank in-process running a chain of ``n`` tiny ``add_scalar`` kernels (8 floats), the
    difference of the process's CPU time between a run of ``LONG`` steps and one of 4 over the acts it
    adds (a run's fixed CPU varies by a few ms: over 20 steps the act read 1-16 us from process to
    process on a quiet machine, over 120 steps 5-7 us).
    CPU time, not wall time: an act's bookkeeping is the interpreter's work, which the in-process ranks
    of a step do one after the other (``step_sim.host_bounds``), and which other processes on a shared
    machine stretch in wall time but not in CPU time; building the actors costs the same in both runs
    and cancels. A hand-off (the reader's thread woken, ``stage_load.handoffs``): the same chain with its
    kernels on ranks 0 and 1 in turn, so each link is a kernel, a send and a receive (an act each), the
    transport's call (``p2p_s``) and two hand-offs, compute to communication and back: what a link costs
    beyond its acts and its call, halved (on this loaded 2-core machine 13-28 us against an act's 2-8).
    Both chains' runs in turns, each figure the median of ``runs``, so a change of load moves both."""
    one, hop = _cpu_a_step((_chain(n, LONG), _chain(n, LONG, hop=True)), threads, 4, LONG, runs)
    act = max(one / (n + 2), 1e-7)
    return act, max((hop / n - 3 * act - p2p_s) / 2, 0.0)


def _cpu_a_step(jobs: tuple[Job, ...], threads: int, short: int, long: int, runs: int) -> list[float]:
    """Each job's process CPU seconds a step in process: ``long`` steps less ``short``, each (job,
    length)'s median of ``runs`` runs, all of them in turns after a warm-up run. The median, not the
    least: the same run's CPU a step moves between spells of this machine (the act read 3.8-11 us from
    one run to the next in one process), and the least of a few is a rare spell's, read 4.2-8.4 us from
    process to process where the median of five read 8.1-10.4."""
    from sbpflow.control_plane.compiler.pipeline import compile as compile_job
    from sbpflow.control_plane.launch.launcher import run

    plans = [compile_job(job) for job in jobs]

    def cpu(plan: Any, steps: int) -> float:
        t = time.process_time()
        run(plan, steps=steps, backend="inprocess", threads=threads, timeout=60)
        return time.process_time() - t

    for plan in plans:
        cpu(plan, short)  # warm: later runs reuse what the first one starts
    got: dict[tuple[int, int], list[float]] = {(i, k): [] for i in range(len(plans)) for k in (short, long)}
    for _ in range(runs):
        for i, steps in got:
            got[(i, steps)].append(cpu(plans[i], steps))
    mid = {key: statistics.median(xs) for key, xs in got.items()}
    return [(mid[(i, long)] - mid[(i, short)]) / (long - short) for i in range(len(plans))]


WARM, WINDOW = 3, 4  # step_time's warm-up steps, and its window


def step_time(compiled: Any, threads: int) -> float:
    """One in-process run of ``compiled`` (a ``pipeline.Compiled``): its fastest ``WINDOW``-step window's
    mean step after ``WARM`` steps. The runtime runs a step ahead, so single step gaps come in pairs; a
    window's mean is not fooled by that, and its fastest is the least disturbed on a shared machine."""
    from sbpflow.control_plane.launch.launcher import run

    marks: list[float] = []
    run(
        compiled,
        backend="inprocess",
        threads=threads,
        timeout=600,
        on_step=lambda *_: marks.append(time.perf_counter()),
    )
    m = marks[WARM:]
    windows = [(m[i + WINDOW] - m[i]) / WINDOW for i in range(len(m) - WINDOW)]
    return min(windows) if windows else float("nan")


def _chain(n: int, steps: int, hop: bool = False) -> Job:
    """A chain of ``n`` tiny kernels on rank 0, or (``hop``) on ranks 0 and 1 in turn."""
    pls, meta = (placement("cpu", [0]), placement("cpu", [1])), TensorMeta((8,), DType.float32)

    def on(i: int) -> Any:
        return pls[i % 2] if hop else pls[0]

    g = Graph()
    g.add_tensor(TensorDecl("x0", meta, placement=on(0), sbp=(B,)))
    g.add_op(OpNode("fill", "full", (), ("x0",), {"shape": (8,), "dtype": DType.float32}, on(0)))
    for i in range(n):
        g.add_tensor(TensorDecl(f"x{i + 1}", meta, placement=on(i + 1), sbp=(B,)))
        g.add_op(OpNode(f"step{i}", "add_scalar", (f"x{i}",), (f"x{i + 1}",), {"value": 1.0}, on(i + 1)))
    g.add_tensor(TensorDecl("loss", TensorMeta((), DType.float32), placement=on(n), sbp=(B,)))
    g.add_op(OpNode("total", "sum", (f"x{n}",), ("loss",), {}, on(n)))
    return Job("act-overhead", g, loss="loss", config=JobConfig(steps=steps))


def read_cost(source: Any, budget: float, rows: int = MAX_ROWS) -> DataCost:
    """What a read of ``source`` costs here: the fastest read of 1 row and of its batch (at most ``rows``
    rows) within ``budget``, taken in turns, each read a step not read before (as training reads them),
    fitted to ``read_s + rows * row_s``. The fixed part is real: a source runs its Python and its
    generator's fixed work per call (the click source's five Philox draws: ~0.6 ms a read here), which a
    per-row figure alone charges to no one. The batch, not a few rows: a rank reads its share of the
    batch or all of it, and a fit over 1 and 16 rows read the MLP's row 0.5-1.3 us from one process to
    the next where 256 rows cost 1.9 us a row."""
    n = max(2, min(rows, int(getattr(source, "batch_size", rows))))
    best = {1: float("inf"), n: float("inf")}
    step = itertools.count()

    def reader(k: int) -> Callable[[], object]:
        return lambda: source.read(next(step), slice(0, k))

    for _ in range(ROUNDS):
        for k in best:
            best[k] = min(best[k], _best(reader(k), budget / 2 / ROUNDS))
    row = max((best[n] - best[1]) / (n - 1), 0.0)
    return DataCost(max(best[1] - row, 0.0), row)


# the synthetic source kinds the examples read, with their default parameters
SOURCES: dict[str, dict[str, float]] = {
    "regression": {"in": 16, "out": 4},
    "tokens": {"seq_len": 16, "vocab": 64},
    "clicks": {"dense": 4, "fields": 4, "vocab": 128},
}


def data_seconds(budget: float) -> dict[str, DataCost]:
    """Each synthetic source kind of :data:`SOURCES` by ``source_key``: its cost a read and a row."""
    out = {}
    for kind, params in SOURCES.items():
        src = SyntheticSource(batch_size=ROWS, kind=kind, params=params, seed=0)
        out[source_key(src)] = read_cost(src, budget / len(SOURCES))
    return out


def measure_cpu_profile(seconds: float = 1.0, threads: int = 1) -> DeviceProfile:
    """This CPU's profile, measured in about ``seconds`` with ``threads`` BLAS threads a rank (1: a Ray
    CPU rank's; 0: the process's setting), in rounds that keep each figure's best (module docstring)."""
    share = max(seconds, 0.1) / 8 / ROUNDS
    best: dict[str, float] = {}
    with limited(threads):
        for _ in range(ROUNDS):
            for name, fn in _RATES.items():
                best[name] = max(best.get(name, 0.0), fn(share))
        data = data_seconds(share * ROUNDS)
    f32 = best["float32"]
    links = measure_links(share * ROUNDS)
    act_s, handoff_s = act_overhead(threads, links["inprocess"].cpu_seconds(Collective.p2p, 2, 32))
    return DeviceProfile(
        name="cpu",
        flops_per_s={"float32": f32, "float64": best["float64"], "bfloat16": f32, "float16": f32},
        mem_bytes_per_s=best["memory"],
        links=links,
        op_overhead_s=act_s,
        handoff_s=handoff_s,
        memory_bytes=_memory_bytes(),
        default_link="shm",
        source=f"measured on this machine ({_cores()} cores, {threads or 'all'} BLAS thread(s) a rank) by "
        "cpu_profile.measure_cpu_profile",
        host_cores=_cores(),
        threads=threads,
        data_row_s={k: c.row_s for k, c in data.items()},
        data_read_s={k: c.read_s for k, c in data.items()},
    )


_RATES: dict[str, Callable[[float], float]] = {
    "float32": lambda budget: gemm_flops(np.float32, budget),
    "float64": lambda budget: gemm_flops(np.float64, budget),
    "memory": elementwise_bandwidth,
}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
