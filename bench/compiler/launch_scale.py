"""Launch-scale benchmark: the compile-scale GPT-3-175B-shaped job launched on 1024 simulated workers.

    python bench/compiler/launch_scale.py          # 96 layers, TP 8 x PP 16 x DP 8 = 1024 ranks
    python bench/compiler/launch_scale.py --layers 4 --tp 2 --pp 4 --dp 8 --micro-batches 4
                                                   # 64 ranks, seconds

The job is ``bench/compiler/compile_scale.py``'s (imported, not copied). It goes the way a Submit goes: the
graph passes once (``pipeline.compile(lower="none")``, the validation compile), then lowering finished on that
state (``pipeline.finish``: lazy above ``LAZY_ABOVE`` tasks, or ``--lower lazy``), then the launch: the
control plane lowers the ranks in batches and serialises each rank's Plan (``Compiled.rank_plans``, the
scheduler's own call), and hands the bytes to that rank's :class:`FakeWorker`, which parses them as a Ray
worker would and checks them (:func:`check_rank_plan`): its DevicePlan and only it, every task's registers
local, every communicator it uses present and holding it, every tensor its registers hold in its tables (a
rank plan carries only the tensors placed on its rank, and no ``Plan.job``). No Ray, no data plane: the
figures are the control plane's, the part that grows with the number of ranks.

Reported: the wall time of each phase (the launch split into the control plane's lowering and
serialising, also in CPU time, and the fake workers' parsing and checking: summed, as they run one after
another here, and the slowest one's, what a launch whose workers parse at once waits for), the peak RSS (``ru_maxrss``; with
``--tracemalloc`` also the peak of Python allocations during the launch), the tasks and bytes shipped.
``--verify N`` compares N ranks' shipped DevicePlans (spread over the stages) with
``Compiled.device_plan(rank)`` lowered alone; ``--verify all`` every rank (doubles the lowering).
Targets on this machine: the launch under 60 s and 4 GB. Run it under a memory cap on a shared machine:
``prlimit --as=8000000000 python bench/compiler/launch_scale.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.compiler import compile_scale  # noqa: E402
from sbpflow.control_plane.compiler import pipeline  # noqa: E402
from sbpflow.v1 import plan_pb2 as pp  # noqa: E402


class PlanCheckError(AssertionError):
    """A rank's shipped Plan is not one a worker can run alone."""


def check_rank_plan(plan: pp.Plan, rank: int, world: frozenset[int]) -> None:
    """What a worker can check of its own Plan before building anything; raise naming what is wrong."""
    if [d.rank for d in plan.devices] != [rank]:
        raise PlanCheckError(f"rank {rank} got DevicePlans of ranks {[d.rank for d in plan.devices]}")
    d = plan.devices[0]
    if not d.tasks:
        raise PlanCheckError(f"rank {rank}'s DevicePlan has no tasks")
    tensors = {t.name for t in plan.tensors}
    unknown = sorted({r.tensor for r in d.registers if r.tensor and r.tensor not in tensors})
    if unknown:
        raise PlanCheckError(f"rank {rank}'s registers hold tensors {unknown[:3]} its plan's tensors lack")
    regs = {r.id for r in d.registers}
    comms = {c.id: c for c in plan.communicators}
    for t in d.tasks:
        foreign = [r for r in (*t.in_registers, *t.out_registers) if r not in regs]
        if foreign:
            raise PlanCheckError(
                f"rank {rank}: task {t.id} ({t.op_name}) names registers {foreign} it does not hold"
            )
        if t.communicator and t.communicator not in comms:
            raise PlanCheckError(
                f"rank {rank}: task {t.id} uses communicator {t.communicator} the plan lacks"
            )
    for c in comms.values():
        if rank not in c.ranks or not set(c.ranks) <= world:
            raise PlanCheckError(f"rank {rank}: communicator {c.id} has ranks {list(c.ranks)}")
    used = {t.communicator for t in d.tasks if t.communicator}
    if used != comms.keys():
        raise PlanCheckError(f"rank {rank}: communicators {sorted(comms.keys() - used)} are not used by it")


def digest(d: pp.DevicePlan) -> str:
    return hashlib.sha256(d.SerializeToString(deterministic=True)).hexdigest()


@dataclass
class FakeWorker:
    """One rank's worker, as far as the launch goes: it receives its serialised Plan, parses and checks it,
    and keeps only what the benchmark reports (the plan itself is dropped, as a real worker turns it into
    actors)."""

    rank: int
    tasks: int = 0
    size: int = 0  # bytes received
    digest: str = ""
    seconds: float = 0.0

    def setup(self, plan_bytes: bytes, ranks: frozenset[int]) -> None:
        t = time.perf_counter()
        plan = pp.Plan.FromString(plan_bytes)
        check_rank_plan(plan, self.rank, ranks)
        d = plan.devices[0]
        self.tasks, self.size, self.digest = len(d.tasks), len(plan_bytes), digest(d)
        self.seconds = time.perf_counter() - t


@dataclass
class Launch:
    workers: dict[int, FakeWorker]
    control_plane_s: float  # lowering and serialising every rank's plan
    control_plane_cpu_s: float  # the same in CPU time: less noisy on a shared machine
    workers_s: float  # the fake workers' parsing and checking, summed (they run one after another here)
    workers_max_s: float  # the slowest worker's: what a real launch, its workers in parallel, waits for
    wall_s: float
    tracemalloc_peak: int | None = None
    verified: list[int] = field(default_factory=list)


def launch(compiled: pipeline.Compiled, batch: int = 32, trace_malloc: bool = False) -> Launch:
    """Ship every rank its Plan, as the Ray scheduler does (``Compiled.rank_plans``), to fake workers."""
    ranks = list(compiled.device_types())
    world = frozenset(ranks)
    workers = {r: FakeWorker(r) for r in ranks}
    if trace_malloc:
        tracemalloc.start()
    t0 = time.perf_counter()
    plans = compiled.rank_plans(ranks, batch)
    control = control_cpu = 0.0
    while True:
        t, c = time.perf_counter(), time.process_time()
        item = next(plans, None)
        control += time.perf_counter() - t
        control_cpu += time.process_time() - c
        if item is None:
            break
        rank, data = item
        workers[rank].setup(data, world)
        del data, item
    wall = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] if trace_malloc else None
    if trace_malloc:
        tracemalloc.stop()
    seconds = [w.seconds for w in workers.values()]
    return Launch(workers, control, control_cpu, sum(seconds), max(seconds), wall, peak)


def verify(compiled: pipeline.Compiled, result: Launch, ranks: list[int]) -> None:
    """The shipped DevicePlans of ``ranks`` equal ``Compiled.device_plan(rank)`` lowered alone."""
    for r in ranks:
        expected = digest(compiled.device_plan(r))
        if result.workers[r].digest != expected:
            raise PlanCheckError(f"rank {r}'s shipped DevicePlan differs from Compiled.device_plan({r})")
        result.verified.append(r)


def sample(ranks: list[int], n: int) -> list[int]:
    """``n`` ranks spread evenly (first and last included), offset by one so most are no representative."""
    if n >= len(ranks):
        return list(ranks)
    step = max(1, (len(ranks) - 1) // max(1, n - 1))
    return sorted({ranks[min(len(ranks) - 1, i * step + 1)] for i in range(n)})


def rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=96)
    for k in ("tp", "pp", "dp", "micro-batches"):
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--lower", choices=["auto", "eager", "lazy"], default="auto")
    ap.add_argument("--batch", type=int, default=32, help="ranks lowered per walk")
    ap.add_argument("--verify", default="8", help="ranks compared with device_plan(rank): a number or 'all'")
    ap.add_argument("--tracemalloc", action="store_true", help="peak of Python allocations during the launch")
    args = ap.parse_args()
    over = {k: getattr(args, k) for k in ("tp", "pp", "dp", "micro_batches") if getattr(args, k) is not None}
    s = compile_scale.Shape(**{**asdict(compile_scale.Shape()), **over, "layers": args.layers})

    t = time.perf_counter()
    job = compile_scale.make_job(s)
    trace_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = pipeline.compile(job, lower="none", cluster_size=s.devices)  # what Submit's validation does
    passes_s = time.perf_counter() - t
    t = time.perf_counter()
    pipeline.finish(compiled, args.lower)  # what the launcher does with it: lowering only
    finish_s = time.perf_counter() - t
    rss_compiled = rss()
    built = len(compiled._devices)
    result = launch(compiled, args.batch, args.tracemalloc)
    rss_launched = rss()
    ranks = sorted(result.workers)
    verify(compiled, result, ranks if args.verify == "all" else sample(ranks, int(args.verify)))

    tasks = sum(w.tasks for w in result.workers.values())
    shipped = sum(w.size for w in result.workers.values())
    lazy = compiled.plan is None
    print(
        f"== {s.layers} layers, TP {s.tp} x PP {s.pp} x DP {s.dp} = {s.devices} ranks, {s.micro_batches} "
        f"micro-batches ({'lowered on demand' if lazy else 'whole plan'}, batches of {args.batch} ranks)"
    )
    print(
        f"   trace {trace_s:.2f} s; graph passes (the validation compile) {passes_s:.2f} s; lowering finished "
        f"on that state {finish_s:.2f} s ({built} rank(s) built); peak RSS after compile {rss_compiled / 1e9:.2f} GB"
    )
    print(
        f"   launch of {len(result.workers)} ranks: {result.wall_s:.2f} s wall = control plane "
        f"{result.control_plane_s:.2f} s (lowering + serialising; {result.control_plane_cpu_s:.2f} s of CPU) + "
        f"workers {result.workers_s:.2f} s "
        f"(parsing + checking, one after another here; the slowest worker {result.workers_max_s:.2f} s, what a "
        f"launch whose workers parse at once waits for); {tasks} tasks, {shipped / 1e9:.2f} GB of Plan shipped "
        f"({shipped / len(result.workers) / 1e6:.1f} MB a rank)"
    )
    print(
        f"   peak RSS {rss_launched / 1e9:.2f} GB"
        + (
            f", tracemalloc peak during the launch {result.tracemalloc_peak / 1e9:.2f} GB"
            if result.tracemalloc_peak
            else ""
        )
        + f"; every worker checked its plan; {len(result.verified)} rank(s) equal to device_plan(rank): "
        f"{result.verified if len(result.verified) <= 16 else 'all'}"
    )
    total = passes_s + finish_s + result.wall_s
    print(f"   compile once + launch: {total:.2f} s")


if __name__ == "__main__":
    main()
