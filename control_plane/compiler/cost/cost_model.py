"""The cost model: the modelled step time of a compiled plan on a device profile.

    profile = load_profile("h200")            # or a JSON file ("cpu", measured here: profiling.pricing)
    est = estimate(compiled, profile)          # compiled: pipeline.compile(job), or its CompileState
    print(est)                                 # compute / comm / exposed comm / step, memory, top ops

**Profiles.** A :class:`DeviceProfile` is one device's peak FLOP rate per dtype, its memory bandwidth, a
fixed cost per op (a kernel launch; on CPU the runtime's per-act work) and, per link kind (``shm``,
``tcp``, ``inprocess``, ``nccl``), a :class:`LinkProfile`: a latency per message and a bandwidth per rank
and direction. Saved profiles are JSON files in ``sbpflow/profiles/`` (``h200.json``: NVIDIA's published
figures); ``cpu``, this machine, is measured by running real code, above the compiler
(``control_plane/profiling/``: ``pricing.device_profile("cpu")``, once a process; about a second).

**Compute** per op is a roofline on one rank's shards: ``max(flops / peak[dtype], bytes / bandwidth)``
plus the per-op overhead, the flops and bytes from each op's ``defop(..., flops=)`` (``sbpflow/ops/flops.py``) on
the local shapes of the op's tensors at mesh coordinate 0, whose shard is the largest of an uneven split.

**Communication** comes from the plan's boxing nodes (``state.boxings``): each step of a ``BoxingPlan``
is a collective of groups of ``p`` ranks on one mesh axis, costing ``hops * latency + bytes / bandwidth``
with the bytes one rank sends (the boxing table's bytes, all ranks together, over the ranks: an all-reduce
``2(p-1)/p |T|``, an all-gather or reduce-scatter ``(p-1)/p |T|``) and the ring's hops (``2(p-1)``,
``p-1``); point to point, the most any rank receives and one hop. Local slices and zero fills are copies.
Where the link's ranks are threads of one process (``inprocess``), a call also holds the interpreter for
the CPU seconds its rank's thread spends in it (``LinkProfile.interpreter``: a call's cost plus its bytes,
not per hop), which the step's interpreter bound adds up over the ranks.

**The step** (``step_sim.py``) is simulated as the runtime runs it: per pipeline stage a compute and an
ordered communication stream, every op starting once its stream is free and its inputs are made, in
lowering's order (``pre``, the schedule's micro-batches, the update). So a gradient's all-reduce overlaps
the backward still to run, a tensor-parallel all-reduce in the forward does not, and pipeline stages
overlap as the schedule lets them. A CPU profile adds what a host shares: its ranks' work over its cores
(with each register a rank hands between its streams at ``handoff_s``, the CPU of a woken thread), one
interpreter for ranks that are threads of one process (the ``inprocess`` link: their kernels whole, their
collectives' CPU, data loading and the acts outside the graph, one rank at a time), and data loading
(``data_read_s`` and ``data_row_s``: a source's seconds a read and a sample row, each rank reading its
rows of each micro-batch where the inputs are placed), which runs ahead and so bounds the step; the step is
the largest bound, and ``StepEstimate.bound`` names it. ``exposed_comm_s`` is ``step_s`` less the same
step with every collective free: what communication adds to the step.

**Memory** is the plan's estimate (``memory.py``, ``Compiled.memory``): the largest device total. A bare
``CompileState`` (compiled with ``lower="none"``) has none; its figure is then the sum of each stage's
local parameter, gradient and optimizer-state bytes plus every activation a micro-batch makes, times
the micro-batches in flight (an upper bound: no register reuse).

Names as issue 15's interface gives them: :class:`DeviceProfile`, :class:`LinkProfile`,
:func:`load_profile`, :class:`StepEstimate`, :func:`estimate` (``plan`` is a ``pipeline.Compiled`` or a
``CompileState``; ``ranks_per_host`` places a CPU profile's ranks). ``measure_cpu_profile`` lives in
``control_plane/profiling/cpu_profile.py``, and :class:`~.step_sim.OpCost` in ``step_sim.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sbpflow.boxing import BoxingPlan, BoxingStep, Collective
from sbpflow.control_plane.compiler.cost import stage_load
from sbpflow.control_plane.compiler.cost.step_sim import OpCost, host_bounds, order, simulate
from sbpflow.control_plane.compiler.lowering.boxing import plan_of
from sbpflow.control_plane.compiler.passes import micro_batching
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import SbpflowError
from sbpflow.graph import BOXING, OpNode
from sbpflow.ops.base import get_op
from sbpflow.ops.flops import work

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
    ``collectives``: (latency, bandwidth) of the collectives measured apart, by ``Collective`` value;
    ``interpreter``: by ``Collective`` value, (seconds a call, bytes a second) of the CPU one rank's
    thread spends in a call, where the link's ranks are threads of one interpreter (``inprocess``: the
    rendezvous and the numpy work of a collective hold the GIL, so the ranks' calls run one at a time;
    ``step_sim.host_bounds`` sums them). Empty: the link costs no interpreter time (separate processes,
    a GPU's NCCL)."""

    latency_s: float
    bytes_per_s: float
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    interpreter: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def seconds(self, collective: Collective, p: int, bytes_per_rank: float) -> float:
        if p <= 1 and collective is not Collective.p2p:
            return 0.0
        latency, bandwidth = self.collectives.get(collective.value, (self.latency_s, self.bytes_per_s))
        return HOPS[collective](p) * latency + bytes_per_rank / bandwidth

    def cpu_seconds(self, collective: Collective, p: int, bytes_per_rank: float) -> float:
        """One rank's interpreter seconds in one call (0 where the link has no such figure): a call's
        own cost, which is not per ring hop (every rank meets the others once at the rendezvous), plus
        the bytes it sends at the rate one thread copies and adds them."""
        figure = self.interpreter.get(collective.value)
        if figure is None or (p <= 1 and collective is not Collective.p2p):
            return 0.0
        return figure[0] + bytes_per_rank / figure[1]


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
    data_read_s: Mapping[str, float] = field(default_factory=dict)  # and its fixed seconds a read
    handoff_s: float = 0.0  # CPU a register handed between a rank's streams costs (a thread woken)

    def data(self, source: object) -> stage_load.DataCost:
        """What a read of ``source`` costs a rank here (nothing for a source the profile has no figures of)."""
        key = stage_load.source_key(source)
        return stage_load.DataCost(self.data_read_s.get(key, 0.0), self.data_row_s.get(key, 0.0))

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
        body["data_read_s"] = dict(self.data_read_s)
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
                data_read_s={k: float(v) for k, v in body.get("data_read_s", {}).items()},
                handoff_s=float(body.get("handoff_s", 0.0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ProfileError(
                f"{where}: not a device profile ({type(e).__name__}: {e}); it needs name, flops_per_s "
                "{dtype: FLOP/s}, mem_bytes_per_s and links {kind: {latency_s, bytes_per_s}} "
                "(see sbpflow/profiles/h200.json)"
            ) from None


def _link(body: Mapping[str, Any]) -> LinkProfile:
    def pairs(key: str) -> dict[str, tuple[float, float]]:
        return {str(k): (float(v[0]), float(v[1])) for k, v in body.get(key, {}).items()}

    return LinkProfile(
        float(body["latency_s"]), float(body["bytes_per_s"]), pairs("collectives"), pairs("interpreter")
    )


# ---- profiles by name --------------------------------------------------------------------------------


def builtin_names() -> list[str]:
    """The saved profiles shipped in ``sbpflow/profiles/`` by name, and ``cpu`` (measured)."""
    files = resources.files("sbpflow").joinpath("profiles")
    return sorted({"cpu", *(Path(f.name).stem for f in files.iterdir() if f.name.endswith(".json"))})


def load_profile(path_or_name: str) -> DeviceProfile:
    """A saved profile by name (``h200``) or a JSON file's path; an unknown name is refused naming the
    known ones. ``cpu``, this machine, is measured, not saved: ``profiling.pricing.device_profile``."""
    if path_or_name == "cpu":
        raise ProfileError(
            "the 'cpu' profile is this machine, measured by running real code: load it with "
            "sbpflow.control_plane.profiling.pricing.device_profile('cpu') (sbpflow plan --profile cpu does)"
        )
    saved = resources.files("sbpflow").joinpath("profiles", f"{path_or_name}.json")
    if "/" not in path_or_name and saved.is_file():
        return DeviceProfile.from_json(saved.read_text(encoding="utf-8"), f"profile {path_or_name!r}")
    path = Path(path_or_name)
    if path.is_file():
        return DeviceProfile.from_json(path.read_text(encoding="utf-8"), str(path))
    raise ProfileError(
        f"no device profile {path_or_name!r}: name one of {builtin_names()} (or 'cpu', this machine, "
        "measured) or give the path of a JSON profile file (DeviceProfile.to_json writes one)"
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
    kernels: Mapping[stage_load.CallKey, float] | None = None,
) -> StepEstimate:
    """The modelled step of ``plan`` on ``profile``'s devices over links of kind ``link`` (default: the
    profile's ``default_link``). A CPU profile's ranks sit ``ranks_per_host`` to a host (0: all on one,
    this machine); ranks over the ``inprocess`` link share one interpreter (``step_sim.host_bounds``).
    ``kernels``: measured seconds of kernel calls (``kernel_probe.measure_kernels``), which replace their
    rooflines."""
    state = plan if isinstance(plan, CompileState) else plan.state
    memory = {} if isinstance(plan, CompileState) else plan.memory
    kind = link or profile.default_link
    costs = {o.name: _op_cost(state, o, profile, profile.link(kind), kernels or {}) for o in state.graph.ops}
    lay = micro_batching.layout(state)
    steps = order(lay)
    ops = {o.name: o for o in state.graph.ops}
    calls: dict[str, int] = {}
    for name, _ in steps:
        calls[name] = calls.get(name, 0) + 1
    by_op = tuple(_times(costs[n], k) for n, k in calls.items())
    loads = stage_load.loads(
        state,
        lay,
        by_op,
        profile.data(state.job.data),
        profile.mem_bytes_per_s,
        (profile.op_overhead_s, profile.handoff_s),
        calls,
    )
    bounds = [
        host_bounds(
            simulate(steps, ops, costs, with_comm),
            loads,
            stage_load.ranks_of(state),
            profile.host_cores,
            profile.threads,
            ranks_per_host,
            kind == "inprocess",
        )
        for with_comm in (True, False)
    ]
    peak, exact = stage_load.peak_memory(state, memory, lay)
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


def _op_cost(
    state: CompileState,
    o: OpNode,
    profile: DeviceProfile,
    link: LinkProfile,
    kernels: Mapping[stage_load.CallKey, float],
) -> OpCost:
    g = state.graph
    if o.op_type == BOXING:
        plan = state.boxings.get(o.name) or plan_of(g, o)
        comm = any(s.collective not in LOCAL for s in plan.steps)
        secs = sum(step_seconds(s, plan, link, profile.mem_bytes_per_s) for s in plan.steps)
        held = sum(step_cpu_seconds(s, plan, link) for s in plan.steps)
        sent = int(sum(per_rank_bytes(s, plan) for s in plan.steps))
        python = profile.op_overhead_s * len(plan.steps)
        return OpCost(o.name, o.op_type, o.stage, comm, max(secs, held) + python, 0, sent, python + held)
    ins = tuple(stage_load.local_meta(g.tensors[i]) for i in o.inputs)
    outs = tuple(stage_load.local_meta(g.tensors[i]) for i in o.outputs)
    w = work(o.op_type, ins, outs, get_op(o.op_type).normalize_attrs(o.attrs))
    dtype = (outs or ins)[0].dtype.value
    roofline = max(w.flops / profile.peak(dtype), w.bytes / profile.mem_bytes_per_s)
    kernel = kernels.get(stage_load.call_key(state, o), roofline) if kernels else roofline
    python = profile.op_overhead_s + max(0.0, kernel - roofline)  # dispatch the roofline does not explain
    return OpCost(o.name, o.op_type, o.stage, False, kernel + profile.op_overhead_s, w.flops, w.bytes, python)


def step_seconds(step: BoxingStep, plan: BoxingPlan, link: LinkProfile, mem_bytes_per_s: float) -> float:
    """One boxing step's seconds on the busiest rank (module docstring)."""
    if step.collective in LOCAL:
        return per_rank_bytes(step, plan) / mem_bytes_per_s
    p = 1 if step.mesh_axis is None else plan.src.shape[step.mesh_axis]
    return link.seconds(step.collective, p, per_rank_bytes(step, plan))


def step_cpu_seconds(step: BoxingStep, plan: BoxingPlan, link: LinkProfile) -> float:
    """One boxing step's interpreter seconds on one rank (``LinkProfile.interpreter``; 0 for a copy)."""
    if step.collective in LOCAL:
        return 0.0
    p = 1 if step.mesh_axis is None else plan.src.shape[step.mesh_axis]
    return link.cpu_seconds(step.collective, p, per_rank_bytes(step, plan))


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
