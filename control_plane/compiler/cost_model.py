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

**Overlap.** The step is simulated as the runtime runs it: per pipeline stage, a compute stream and a
communication stream, each in the plan's order (the runtime's communication stream is ordered), every op
starting once its stream is free and its inputs are made. Ops that read only parameters run once
(``pre``), those that depend on the data once per micro-batch in the schedule's order
(``micro_batching.layout``; the schedule's timeline), then the update (``step``). So a gradient's
all-reduce overlaps the backward still to run, a tensor-parallel all-reduce in the forward does not, and
pipeline stages overlap as the schedule lets them. ``exposed_comm_s`` is ``step_s`` less the same
simulation with every collective free: what communication adds to the step.

**Memory** is the plan's estimate (``memory.py``, ``Compiled.memory``): the largest device total. A bare
``CompileState`` (compiled with ``lower="none"``) has none; its figure is then the sum of each stage's
local parameter, gradient and optimizer-state bytes plus every activation a micro-batch makes, times
the micro-batches in flight (an upper bound: no register reuse).

Names as issue 15's interface gives them: :class:`DeviceProfile`, :class:`LinkProfile`,
:func:`load_profile`, :class:`StepEstimate`, :func:`estimate` (``plan`` is a ``pipeline.Compiled`` or a
``CompileState``). :func:`measure_cpu_profile` lives in ``cpu_profile.py``; ``load_profile("cpu")`` calls
it.
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
    """One link kind: a latency per message (s) and what one rank sends per second in one direction."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, collective: Collective, p: int, bytes_per_rank: float) -> float:
        if p <= 1 and collective is not Collective.p2p:
            return 0.0
        return HOPS[collective](p) * self.latency_s + bytes_per_rank / self.bytes_per_s


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
        body["flops_per_s"], body["links"] = (
            dict(self.flops_per_s),
            {k: asdict(v) for k, v in self.links.items()},
        )
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> DeviceProfile:
        try:
            body = json.loads(text)
            links = {
                k: LinkProfile(float(v["latency_s"]), float(v["bytes_per_s"]))
                for k, v in body["links"].items()
            }
            return cls(
                name=str(body["name"]),
                flops_per_s={k: float(v) for k, v in body["flops_per_s"].items()},
                mem_bytes_per_s=float(body["mem_bytes_per_s"]),
                links=links,
                op_overhead_s=float(body.get("op_overhead_s", 0.0)),
                memory_bytes=int(body.get("memory_bytes", 0)),
                default_link=str(body.get("default_link", "shm")),
                source=str(body.get("source", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ProfileError(
                f"{where}: not a device profile ({type(e).__name__}: {e}); it needs name, flops_per_s "
                "{dtype: FLOP/s}, mem_bytes_per_s and links {kind: {latency_s, bytes_per_s}} "
                "(see sbpflow/profiles/h200.json)"
            ) from None


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
class OpCost:
    """One op's modelled seconds per step (all its micro-batches), on its stage's busiest rank."""

    name: str
    op_type: str
    stage: int
    comm: bool  # on the communication stream (a boxing node's messages)
    seconds: float
    flops: int = 0  # per step, one rank
    bytes: int = 0  # per step, one rank: moved in memory (compute) or sent (communication)


@dataclass(frozen=True)
class StepEstimate:
    """The modelled step: busy seconds of the busiest rank, and the simulated step (module docstring).

    ``compute_s``: the busiest stage's compute per step; ``comm_s``: its communication, summed over the
    pipeline's stages (one rank of each), so ``0 <= exposed_comm_s <= comm_s`` always;
    ``exposed_comm_s``: what communication adds to the simulated step; ``step_s``: the simulated step.
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

    @property
    def overlapped_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    def top(self, n: int = 5) -> list[OpCost]:
        return sorted(self.by_op, key=lambda c: -c.seconds)[:n]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        mem = "" if self.memory_from_plan else " (upper bound: no memory estimate in the plan)"
        out = [
            f"modelled step on {self.profile} (link {self.link}): {self.step_s * 1e3:.3f} ms = compute "
            f"{self.compute_s * 1e3:.3f} ms + exposed comm {self.exposed_comm_s * 1e3:.3f} ms" + _rest(self),
            f"  communication {self.comm_s * 1e3:.3f} ms, of it overlapped with compute "
            f"{self.overlapped_comm_s * 1e3:.3f} ms",
            f"  peak memory per device {self.peak_memory_bytes:,d} B{mem}",
            "  most expensive ops (ms per step):",
        ]
        out += [
            f"    {c.seconds * 1e3:9.3f}  {c.name} ({c.op_type}{', comm' if c.comm else ''}, stage {c.stage})"
            for c in self.top()
        ]
        return out


def _rest(e: StepEstimate) -> str:
    idle = e.step_s - e.compute_s - e.exposed_comm_s
    return f" + idle {idle * 1e3:.3f} ms (pipeline bubble, waits)" if idle > 1e-12 else ""


Order = list[tuple[str, int | None]]  # (op, micro-batch; None: once per step)


def estimate(plan: Compiled | CompileState, profile: DeviceProfile, link: str | None = None) -> StepEstimate:
    """The modelled step of ``plan`` on ``profile``'s devices over links of kind ``link`` (default: the
    profile's ``default_link``)."""
    state = plan if isinstance(plan, CompileState) else plan.state
    memory = {} if isinstance(plan, CompileState) else plan.memory
    kind = link or profile.default_link
    costs = {o.name: _op_cost(state, o, profile, profile.link(kind)) for o in state.graph.ops}
    lay = micro_batching.layout(state)
    order: Order = [(n, None) for n in lay.pre]
    for stage, action in lay.schedule.timeline():
        order += [(n, action.micro_batch) for n in lay.slots.get((stage, action.phase), ())]
    order += [(n, None) for n in lay.step]
    ops = {o.name: o for o in state.graph.ops}
    step_s = _simulate(order, ops, costs, with_comm=True)
    alone = _simulate(order, ops, costs, with_comm=False)
    busy: dict[tuple[int, bool], float] = {}
    calls: dict[str, int] = {}
    for name, _ in order:
        c = costs[name]
        busy[(c.stage, c.comm)] = busy.get((c.stage, c.comm), 0.0) + c.seconds
        calls[name] = calls.get(name, 0) + 1
    peak, exact = _peak_memory(state, memory, lay)
    return StepEstimate(
        compute_s=max((v for (_, comm), v in busy.items() if not comm), default=0.0),
        comm_s=sum(v for (_, comm), v in busy.items() if comm),
        exposed_comm_s=max(0.0, step_s - alone),
        step_s=step_s,
        peak_memory_bytes=peak,
        by_op=tuple(_times(costs[n], k) for n, k in calls.items()),
        profile=profile.name,
        link=kind,
        memory_from_plan=exact,
    )


def _times(c: OpCost, k: int) -> OpCost:
    return OpCost(c.name, c.op_type, c.stage, c.comm, c.seconds * k, c.flops * k, c.bytes * k)


def _simulate(order: Order, ops: Mapping[str, OpNode], costs: Mapping[str, OpCost], with_comm: bool) -> float:
    """The simulated step: each (op, micro-batch) in ``order`` starts when its stream (stage, compute or
    communication) is free and its inputs are made; ``with_comm=False`` makes every message free."""
    free: dict[tuple[int, bool], float] = {}
    ready: dict[tuple[str, int | None], float] = {}  # (tensor, micro-batch); None: once, or the last one
    end = 0.0
    for name, k in order:
        o, c = ops[name], costs[name]
        t_in = max((ready.get((i, k), ready.get((i, None), 0.0)) for i in o.inputs), default=0.0)
        stream = (c.stage, c.comm)
        done = max(free.get(stream, 0.0), t_in) + (c.seconds if with_comm or not c.comm else 0.0)
        free[stream] = done
        for out in o.outputs:
            ready[(out, k)] = done
            if k is not None:
                ready[(out, None)] = max(ready.get((out, None), 0.0), done)
        end = max(end, done)
    return end


def _op_cost(state: CompileState, o: OpNode, profile: DeviceProfile, link: LinkProfile) -> OpCost:
    g = state.graph
    if o.op_type == BOXING:
        plan = state.boxings.get(o.name) or plan_of(g, o)
        comm = any(s.collective not in LOCAL for s in plan.steps)
        secs = sum(step_seconds(s, plan, link, profile.mem_bytes_per_s) for s in plan.steps)
        sent = int(sum(per_rank_bytes(s, plan) for s in plan.steps))
        return OpCost(
            o.name, o.op_type, o.stage, comm, secs + profile.op_overhead_s * len(plan.steps), 0, sent
        )
    ins = tuple(_local(g.tensors[i]) for i in o.inputs)
    outs = tuple(_local(g.tensors[i]) for i in o.outputs)
    w = work(o.op_type, ins, outs, get_op(o.op_type).normalize_attrs(o.attrs))
    dtype = (outs or ins)[0].dtype.value
    secs = max(w.flops / profile.peak(dtype), w.bytes / profile.mem_bytes_per_s) + profile.op_overhead_s
    return OpCost(o.name, o.op_type, o.stage, False, secs, w.flops, w.bytes)


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
            t = g.tensors[out]
            many = lay.schedule.in_flight(o.stage) if o.name in per_mb else 1
            held[o.stage] = held.get(o.stage, 0) + _local(t).nbytes * many
    for t in g.tensors.values():
        if t.kind in (TensorKind.parameter, TensorKind.optimizer_state):
            stage = min((o.stage for o in g.consumers(t.name)), default=0)
            held[stage] = held.get(stage, 0) + _local(t).nbytes
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
