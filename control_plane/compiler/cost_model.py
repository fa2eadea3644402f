"""The cost model: the modelled step time of a compiled plan on a device profile.

    profile = load_profile("h200")            # or "cpu" (this machine, measured once), or a JSON file
    est = estimate(compiled, profile)          # compiled: pipeline.compile(job), or its CompileState
    print(est)                                 # compute / comm / exposed comm / step, memory, top ops

**Profiles.** A :class:`DeviceProfile` is one device's peak FLOP rate per dtype, its memory bandwidth, a
fixed cost per op (a kernel launch; on CPU the runtime's per-act work) and, per link kind (``shm``,
``tcp``, ``inprocess``, ``nccl``), a :class:`LinkProfile`: a latency per message and a bandwidth per rank
and direction. Saved profiles are JSON files in ``sbpflow/profiles/`` (``h200.json``: NVIDIA's published
figures); ``cpu`` is this machine measured at first use (:func:`measure_cpu_profile`, in
``cpu_profile.py``; about a second).

**Compute** per op is a roofline on one rank's shards: ``max(flops / peak[dtype], bytes / bandwidth)``
plus the per-op overhead, the flops and bytes from the op library's table (``sbpflow/ops/flops.py``) on
the local shapes of the op's tensors at mesh coordinate 0, whose shard is the largest of an uneven split.

**Communication** comes from the plan's boxing nodes (``state.boxings``): each step of a ``BoxingPlan``
is a collective of groups of ``p`` ranks on one mesh axis, costing ``hops * latency + bytes / bandwidth``
with the bytes one rank sends (the boxing table's bytes, all ranks together, over the ranks: an all-reduce
``2(p-1)/p |T|``, an all-gather or reduce-scatter ``(p-1)/p |T|``) and the ring's hops (``2(p-1)``,
``p-1``); point to point, the most any rank receives and one hop. Local slices and zero fills are copies.

**The step** (``step_sim.py``) is simulated as the runtime runs it: per pipeline stage a compute and an
ordered communication stream, every op starting once its stream is free and its inputs are made, in
lowering's order (``pre``, the schedule's micro-batches, the update). So a gradient's all-reduce overlaps
the backward still to run, a tensor-parallel all-reduce in the forward does not, and pipeline stages
overlap as the schedule lets them. A CPU profile adds what a host shares: its ranks' work over its cores,
one interpreter for ranks that are threads of one process (the ``inprocess`` link), and data loading
(``data_row_s``: a source's seconds per sample row), which runs ahead and so bounds the step; the step is
the largest bound, and ``StepEstimate.bound`` names it. ``exposed_comm_s`` is ``step_s`` less the same
step with every collective free: what communication adds to the step.

**Memory** is the plan's estimate (``memory.py``, ``Compiled.memory``): the largest device total. A bare
``CompileState`` (compiled with ``lower="none"``) has none; its figure is then the sum of each stage's
local parameter, gradient and optimizer-state bytes plus every activation a micro-batch makes, times
the micro-batches in flight (an upper bound: no register reuse).

Names as issue 15's interface gives them: :class:`DeviceProfile`, :class:`LinkProfile`,
:func:`load_profile`, :class:`StepEstimate`, :func:`estimate` (``plan`` is a ``pipeline.Compiled`` or a
``CompileState``; ``ranks_per_host`` places a CPU profile's ranks). :func:`measure_cpu_profile` lives in
``cpu_profile.py`` (``load_profile("cpu")`` calls it), and :class:`~.step_sim.OpCost` in ``step_sim.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sbpflow.boxing import BoxingPlan, BoxingStep, Collective
from sbpflow.control_plane.compiler import micro_batching
from sbpflow.control_plane.compiler.lowering.boxing import plan_of
from sbpflow.control_plane.compiler.lowering.tasks import shard_shape
from sbpflow.control_plane.compiler.memory import DeviceMemory
from sbpflow.control_plane.compiler.micro_batching import Layout
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.compiler.step_sim import Load, OpCost, host_bounds, order, simulate
from sbpflow.errors import SbpflowError
from sbpflow.graph import BOXING, OpNode, TensorDecl, TensorKind
from sbpflow.ops.base import get_op
from sbpflow.ops.flops import work
from sbpflow.sbp import NdSbp
from sbpflow.tensor_meta import TensorMeta

if TYPE_CHECKING:
    from sbpflow.control_plane.compiler.pipeline import Compiled


class ProfileError(SbpflowError, ValueError):
    """A device profile that cannot be found or read."""


# messages in one ring collective of p ranks, each paying the link's latency once
HOPS: dict[Collective, Any] = {
    Collective.all_reduce: lambda p: 2 * (p - 1),
    Collective.reduce_scatter: lambda p: p - 1,
    Collective.all_gather: lambda p: p - 1,
    Collective.all_to_all: lambda p: p - 1,
    Collective.p2p: lambda p: 1,
    Collective.local_slice: lambda p: 0,
    Collective.zero_fill: lambda p: 0,
}
LOCAL = frozenset({Collective.local_slice, Collective.zero_fill})  # copies on the device, not messages


@dataclass(frozen=True)
class LinkProfile:
    """One link kind: a latency per message (s) and what one rank sends per second in one direction;
    ``collectives``: (latency, bandwidth) of the collectives measured apart, by ``Collective`` value."""

    latency_s: float
    bytes_per_s: float
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def seconds(self, collective: Collective, p: int, bytes_per_rank: float) -> float:
        if p <= 1 and collective is not Collective.p2p:
            return 0.0
        latency, bandwidth = self.collectives.get(collective.value, (self.latency_s, self.bytes_per_s))
        return HOPS[collective](p) * latency + bytes_per_rank / bandwidth


@dataclass(frozen=True)
class DeviceProfile:
    """One device: peak FLOP/s by dtype name, memory bandwidth, the fixed cost of one op, and its links."""

    name: str
    flops_per_s: Mapping[str, float]
    mem_bytes_per_s: float
    links: Mapping[str, LinkProfile]
    op_overhead_s: float = 0.0
    memory_bytes: int = 0  # the device's memory; 0 where unknown
    default_link: str = "shm"
    source: str = ""  # where the figures come from
    host_cores: int = 0  # a CPU rank's host: its cores, which the ranks on it share; 0: a device of its own
    threads: int = 0  # the BLAS threads one rank's rates were measured with (0: every core of the host)
    data_row_s: Mapping[str, float] = field(default_factory=dict)  # a data source's seconds a sample row

    def __post_init__(self) -> None:
        if not self.flops_per_s or min(self.flops_per_s.values()) <= 0 or self.mem_bytes_per_s <= 0:
            raise ProfileError(
                f"profile {self.name!r}: flops_per_s and mem_bytes_per_s must be positive, got "
                f"{dict(self.flops_per_s)} and {self.mem_bytes_per_s}"
            )
        if self.default_link not in self.links:
            raise ProfileError(
                f"profile {self.name!r}: default_link {self.default_link!r} is not one of its links "
                f"{sorted(self.links)}; add it to links or name one of them"
            )

    def peak(self, dtype: str) -> float:
        """FLOP/s for ``dtype``; a dtype without its own figure (an integer op) runs at the float32 rate."""
        return (
            self.flops_per_s.get(dtype) or self.flops_per_s.get("float32") or max(self.flops_per_s.values())
        )

    def link(self, kind: str | None = None) -> LinkProfile:
        kind = kind or self.default_link
        if kind not in self.links:
            raise ProfileError(
                f"profile {self.name!r} has no link {kind!r}; its links are {sorted(self.links)}"
            )
        return self.links[kind]

    def to_json(self) -> str:
        body = asdict(self)
        body["flops_per_s"], body["data_row_s"] = dict(self.flops_per_s), dict(self.data_row_s)
        body["links"] = {k: asdict(v) for k, v in self.links.items()}
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> DeviceProfile:
        try:
            body = json.loads(text)
            links = {k: _link(v) for k, v in body["links"].items()}
            return cls(
                name=str(body["name"]),
                flops_per_s={k: float(v) for k, v in body["flops_per_s"].items()},
                mem_bytes_per_s=float(body["mem_bytes_per_s"]),
                links=links,
                op_overhead_s=float(body.get("op_overhead_s", 0.0)),
                memory_bytes=int(body.get("memory_bytes", 0)),
                default_link=str(body.get("default_link", "shm")),
                source=str(body.get("source", "")),
                host_cores=int(body.get("host_cores", 0)),
                threads=int(body.get("threads", 0)),
                data_row_s={k: float(v) for k, v in body.get("data_row_s", {}).items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ProfileError(
                f"{where}: not a device profile ({type(e).__name__}: {e}); it needs name, flops_per_s "
                "{dtype: FLOP/s}, mem_bytes_per_s and links {kind: {latency_s, bytes_per_s}} "
                "(see sbpflow/profiles/h200.json)"
            ) from None


def _link(body: Mapping[str, Any]) -> LinkProfile:
    by = {str(k): (float(v[0]), float(v[1])) for k, v in body.get("collectives", {}).items()}
    return LinkProfile(float(body["latency_s"]), float(body["bytes_per_s"]), by)


# ---- profiles by name --------------------------------------------------------------------------------


def builtin_names() -> list[str]:
    """The saved profiles shipped in ``sbpflow/profiles/`` by name, and ``cpu`` (measured)."""
    files = resources.files("sbpflow").joinpath("profiles")
    return sorted({"cpu", *(Path(f.name).stem for f in files.iterdir() if f.name.endswith(".json"))})


_MEASURED: dict[str, DeviceProfile] = {}


def load_profile(path_or_name: str) -> DeviceProfile:
    """A saved profile by name (``h200``), ``cpu`` (this machine, measured once per process), or a JSON
    file's path; an unknown name is refused naming the known ones."""
    if path_or_name == "cpu":
        if "cpu" not in _MEASURED:
            from sbpflow.control_plane.compiler.cpu_profile import measure_cpu_profile

            _MEASURED["cpu"] = measure_cpu_profile()
        return _MEASURED["cpu"]
    saved = resources.files("sbpflow").joinpath("profiles", f"{path_or_name}.json")
    if "/" not in path_or_name and saved.is_file():
        return DeviceProfile.from_json(saved.read_text(encoding="utf-8"), f"profile {path_or_name!r}")
    path = Path(path_or_name)
    if path.is_file():
        return DeviceProfile.from_json(path.read_text(encoding="utf-8"), str(path))
    raise ProfileError(
        f"no device profile {path_or_name!r}: name one of {builtin_names()} or give the path of a JSON "
        "profile file (DeviceProfile.to_json writes one)"
    )


# ---- the estimate ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepEstimate:
    """The modelled step (module docstring).

    ``compute_s``: the busiest stage's compute per step, one rank; ``comm_s``: communication, summed over
    the pipeline's stages (one rank of each), so ``0 <= exposed_comm_s <= comm_s`` always;
    ``exposed_comm_s``: what communication adds to the step; ``step_s``: the step, the largest of the
    bounds of ``step_sim`` (``bound`` names it); ``data_s``: the slowest rank's data loading.
    """

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    peak_memory_bytes: int
    by_op: tuple[OpCost, ...] = field(default=(), repr=False)
    profile: str = ""
    link: str = ""
    memory_from_plan: bool = True  # False: the upper bound of a plan without a memory estimate
    data_s: float = 0.0
    bound: str = "the critical path"

    @property
    def overlapped_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    def top(self, n: int = 5) -> list[OpCost]:
        return sorted(self.by_op, key=lambda c: -c.seconds)[:n]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        mem = "" if self.memory_from_plan else " (upper bound: no memory estimate in the plan)"
        idle = self.step_s - self.compute_s - self.exposed_comm_s
        out = [
            f"modelled step on {self.profile} (link {self.link}): {self.step_s * 1e3:.3f} ms = compute "
            f"{self.compute_s * 1e3:.3f} ms + exposed comm {self.exposed_comm_s * 1e3:.3f} ms"
            + (f" + waits {idle * 1e3:.3f} ms" if idle > 1e-12 else "")
            + f"; bound by {self.bound}",
            f"  communication {self.comm_s * 1e3:.3f} ms, of it overlapped with compute "
            f"{self.overlapped_comm_s * 1e3:.3f} ms; data loading {self.data_s * 1e3:.3f} ms (prefetched)",
            f"  peak memory per device {self.peak_memory_bytes:,d} B{mem}",
            "  most expensive ops (ms per step):",
        ]
        out += [
            f"    {c.seconds * 1e3:9.3f}  {c.name} ({c.op_type}{', comm' if c.comm else ''}, stage {c.stage})"
            for c in self.top()
        ]
        return out


def estimate(
    plan: Compiled | CompileState,
    profile: DeviceProfile,
    link: str | None = None,
    ranks_per_host: int = 0,
) -> StepEstimate:
    """The modelled step of ``plan`` on ``profile``'s devices over links of kind ``link`` (default: the
    profile's ``default_link``). A CPU profile's ranks sit ``ranks_per_host`` to a host (0: all on one,
    this machine); ranks over the ``inprocess`` link share one interpreter (``step_sim.host_bounds``)."""
    state = plan if isinstance(plan, CompileState) else plan.state
    memory = {} if isinstance(plan, CompileState) else plan.memory
    kind = link or profile.default_link
    costs = {o.name: _op_cost(state, o, profile, profile.link(kind)) for o in state.graph.ops}
    lay = micro_batching.layout(state)
    steps = order(lay)
    ops = {o.name: o for o in state.graph.ops}
    calls: dict[str, int] = {}
    for name, _ in steps:
        calls[name] = calls.get(name, 0) + 1
    by_op = tuple(_times(costs[n], k) for n, k in calls.items())
    loads = _loads(state, lay, by_op, profile)
    bounds = [
        host_bounds(
            simulate(steps, ops, costs, with_comm),
            loads,
            _ranks_of(state),
            profile.host_cores,
            profile.threads,
            ranks_per_host,
            kind == "inprocess",
        )
        for with_comm in (True, False)
    ]
    peak, exact = _peak_memory(state, memory, lay)
    return StepEstimate(
        compute_s=max((x.compute_s for x in loads.values()), default=0.0),
        comm_s=sum(c.seconds for c in by_op if c.comm),
        exposed_comm_s=max(0.0, bounds[0].step_s - bounds[1].step_s),
        step_s=bounds[0].step_s,
        peak_memory_bytes=peak,
        by_op=by_op,
        profile=profile.name,
        link=kind,
        memory_from_plan=exact,
        data_s=bounds[0].data_s,
        bound=bounds[0].name,
    )


def _times(c: OpCost, k: int) -> OpCost:
    return OpCost(c.name, c.op_type, c.stage, c.comm, c.seconds * k, c.flops * k, c.bytes * k, c.python_s * k)


def _loads(
    state: CompileState, lay: Layout, by_op: tuple[OpCost, ...], profile: DeviceProfile
) -> dict[int, Load]:
    """Each stage's :class:`~.step_sim.Load` on one rank: its compute, and its data loading (each
    micro-batch's local rows at the source's cost a row, and their bytes at memory bandwidth)."""
    g, first = state.graph, _first_reader_stage(state)
    row_s = profile.data_row_s.get(source_key(state.job.data), 0.0)
    rows: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    for t in g.of_kind(TensorKind.input):
        stage = first.get(t.name, 0)
        local = _local(t)
        rows[stage] = max(rows.get(stage, 0), local.shape[0] if local.shape else 1)
        nbytes[stage] = nbytes.get(stage, 0) + local.nbytes
    tail = _plan_acts(state, lay, first)
    per_stage: dict[int, list[OpCost]] = {}
    for c in by_op:
        per_stage.setdefault(c.stage, []).append(c)
    out = {}
    for stage in sorted(set(per_stage) | set(rows)):
        mine = per_stage.get(stage, [])
        data = lay.micro_batches * (
            rows.get(stage, 0) * row_s + nbytes.get(stage, 0) / profile.mem_bytes_per_s
        )
        extra = tail.get(stage, 0) * profile.op_overhead_s
        out[stage] = Load(
            compute_s=sum(c.seconds for c in mine if not c.comm) + extra,
            python_s=sum(c.python_s for c in mine) + data + extra,
            data_s=data,
            tail_s=extra,
        )
    return out


def _plan_acts(state: CompileState, lay: Layout, first: Mapping[str, int]) -> dict[int, int]:
    """Per stage, the acts of a step that run no op of the graph: each variable's write-back, each input's
    load and each accumulation per micro-batch (when there are several), the fetches."""
    g = state.graph
    producer = {t: o for o in g.ops for t in o.outputs}
    out: dict[int, int] = {}

    def add(tensor: str, n: int) -> None:
        op = producer.get(tensor)
        stage = first.get(tensor, 0) if op is None else op.stage
        out[stage] = out.get(stage, 0) + n

    m = lay.micro_batches
    for new in state.updates.values():
        add(new, 1)
    for t in g.of_kind(TensorKind.input):
        add(t.name, m)
    for t in lay.accumulate if m > 1 else ():
        add(t, m)
    for t in (state.job.loss, *state.job.fetches):
        if t:
            add(t, 1)
    return out


def _first_reader_stage(state: CompileState) -> dict[str, int]:
    """Each tensor read by an op -> the earliest stage that reads it (one pass: big graphs)."""
    out: dict[str, int] = {}
    for o in state.graph.ops:
        for t in o.inputs:
            out[t] = min(out.get(t, o.stage), o.stage)
    return out


def source_key(source: object) -> str:
    """A data source's key in ``DeviceProfile.data_row_s``: its class, and a synthetic source's kind."""
    kind = getattr(source, "kind", None)
    return type(source).__name__ + (f":{kind}" if isinstance(kind, str) else "")


def _ranks_of(state: CompileState) -> dict[int, tuple[int, ...]]:
    """Each pipeline stage's ranks: those of its ops' placements."""
    out: dict[int, set[int]] = {}
    g = state.graph
    for o in g.ops:
        pl = o.placement or next((g.tensors[t].placement for t in o.outputs), None)
        if pl is not None:
            out.setdefault(o.stage, set()).update(pl.ranks)
    return {s: tuple(sorted(r)) for s, r in out.items()}


def _op_cost(state: CompileState, o: OpNode, profile: DeviceProfile, link: LinkProfile) -> OpCost:
    g = state.graph
    if o.op_type == BOXING:
        plan = state.boxings.get(o.name) or plan_of(g, o)
        comm = any(s.collective not in LOCAL for s in plan.steps)
        secs = sum(step_seconds(s, plan, link, profile.mem_bytes_per_s) for s in plan.steps)
        sent = int(sum(per_rank_bytes(s, plan) for s in plan.steps))
        python = profile.op_overhead_s * len(plan.steps)
        return OpCost(o.name, o.op_type, o.stage, comm, secs + python, 0, sent, python)
    ins = tuple(_local(g.tensors[i]) for i in o.inputs)
    outs = tuple(_local(g.tensors[i]) for i in o.outputs)
    w = work(o.op_type, ins, outs, get_op(o.op_type).normalize_attrs(o.attrs))
    dtype = (outs or ins)[0].dtype.value
    secs = max(w.flops / profile.peak(dtype), w.bytes / profile.mem_bytes_per_s) + profile.op_overhead_s
    return OpCost(o.name, o.op_type, o.stage, False, secs, w.flops, w.bytes, profile.op_overhead_s)


def _local(t: TensorDecl) -> TensorMeta:
    """``t``'s shard at mesh coordinate 0: the largest of an uneven split (a partial one is whole)."""
    assert t.placement is not None and t.sbp is not None, f"tensor {t.name!r} has no layout"
    return _shard(t.meta, t.placement.shape, t.sbp)


@lru_cache(maxsize=1 << 16)
def _shard(meta: TensorMeta, mesh: tuple[int, ...], sbp: NdSbp) -> TensorMeta:
    return TensorMeta(shard_shape(meta.shape, mesh, sbp, (0,) * len(mesh)), meta.dtype)


def _peak_memory(state: CompileState, memory: Mapping[int, DeviceMemory], lay: Layout) -> tuple[int, bool]:
    """The plan's largest device total, or (none in the plan) the upper bound of the module docstring."""
    if memory:
        return max(m.total for m in memory.values()), True
    g = state.graph
    per_mb = {o for names in lay.slots.values() for o in names}
    held: dict[int, float] = {}
    for o in g.ops:
        if o.op_type == BOXING and o.name not in per_mb:
            continue
        for out in o.outputs:
            many = lay.schedule.in_flight(o.stage) if o.name in per_mb else 1
            held[o.stage] = held.get(o.stage, 0) + _local(g.tensors[out]).nbytes * many
    first = _first_reader_stage(state)
    for t in g.tensors.values():
        stage = first.get(t.name, 0)
        if t.kind in (TensorKind.parameter, TensorKind.optimizer_state):
            held[stage] = held.get(stage, 0) + _local(t).nbytes
        elif t.kind == TensorKind.input:  # the loader's buffer and its prefetch copy
            held[stage] = held.get(stage, 0) + 2 * _local(t).nbytes * lay.micro_batches
    return int(max(held.values(), default=0)), False


def step_seconds(step: BoxingStep, plan: BoxingPlan, link: LinkProfile, mem_bytes_per_s: float) -> float:
    """One boxing step's seconds on the busiest rank (module docstring)."""
    if step.collective in LOCAL:
        return per_rank_bytes(step, plan) / mem_bytes_per_s
    p = 1 if step.mesh_axis is None else plan.src.shape[step.mesh_axis]
    return link.seconds(step.collective, p, per_rank_bytes(step, plan))


def per_rank_bytes(step: BoxingStep, plan: BoxingPlan) -> float:
    """What one rank sends in ``step``: its share of a collective's bytes; point to point the most any one
    rank receives (the transfers a rank holds already move nothing)."""
    if step.collective is not Collective.p2p:
        if step.collective in LOCAL:
            return plan.meta.nbytes / plan.dst.size
        return step.bytes / plan.src.size
    got: dict[int, int] = {}
    for tr in step.transfers:
        if tr.src != tr.dst:
            got[tr.dst] = got.get(tr.dst, 0) + tr.numel * plan.meta.dtype.itemsize
    if got:
        return max(got.values())
    return step.bytes / max(plan.dst.size, 1)
