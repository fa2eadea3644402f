"""The compiler driver: ``compile(job)`` runs the passes in order and lowers the result to a Plan.

    CompileState.start -> autodiff -> optimizer -> mixed_precision -> zero -> recompute
        -> sbp_inference -> boxing_pass -> fusion -> grad_buckets -> micro_batching -> lowering
        -> memory -> comm_order.check

Each pass is a module of this package with ``run(state)``; :data:`PASSES` is the tuple of them, in order
(the first six, the graph rewrites, are also :data:`~.passes.rewrites.REWRITES`). A pass with nothing to do for a job (no optimizer, no
ZeRO) returns at once. ``Graph.verify`` runs after every pass, and every pass's wall time is recorded (the
compile-scale benchmark reports them); from ``boxing_pass`` on, ``verify.verify_compiled`` runs after
every pass too (each op reads exactly the SBP its signature asks for). ``compile(job, cluster_size=N)``
first refuses a placement with a rank outside ``0 .. N-1``. Lowering needs every tensor's placement and
SBP; when the passes that provide them are missing and the job does not annotate every tensor, lowering
is skipped with a note and ``Compiled.plan`` is ``None``.

Lowering materialises every rank's tasks (``Compiled.plan``) unless the job is big: above
``LAZY_ABOVE`` estimated tasks (or with ``lower="lazy"``) the plan is lowered on demand —
``Compiled.device_plan(rank)`` / ``Compiled.rank_plan(rank)`` build one rank's DevicePlan (cached), equal
to its entry in the full plan — which is what a control plane ships each worker anyway
(``Compiled.rank_plans``: a rank's Plan is its DevicePlan, its communicators and the header's tables
as far as they concern it — the tensors placed on the rank, and no ``Plan.job``, which the runtime never
reads; ``Compiled.header()`` is the whole header). The compile itself then lowers one representative
rank per memory class (``memory.rank_classes``: a pipeline stage with even splits is one class) for the
memory estimate, and proves the communicator order from the walk's one sequence of boxing steps
(``check_order``) instead of from every rank's tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal, TypeVar

from sbpflow.codec import wire
from sbpflow.control_plane.compiler import attention_core, comm_order, memory, plan_size
from sbpflow.control_plane.compiler.lowering import lower as lowering
from sbpflow.control_plane.compiler.lowering.boxing import Memo
from sbpflow.control_plane.compiler.lowering.on_demand import LAZY_ABOVE, check_order, estimate_tasks
from sbpflow.control_plane.compiler.lowering.tasks import LoweringError
from sbpflow.control_plane.compiler.memory import DeviceMemory
from sbpflow.control_plane.compiler.passes import (
    autodiff,
    boxing_pass,
    fusion,
    grad_buckets,
    micro_batching,
    mixed_precision,
    optimizer,
    recompute,
    running_stats,
    sbp_inference,
    zero,
)
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.control_plane.compiler.verify import verify_compiled
from sbpflow.errors import PlacementError
from sbpflow.graph import BOXING, Graph
from sbpflow.job import Job
from sbpflow.limits import CompileBudget
from sbpflow.placement import Placement
from sbpflow.sbp import format_nd
from sbpflow.v1 import job_pb2 as jp
from sbpflow.v1 import plan_pb2 as pp

T = TypeVar("T")

# Every graph pass, in the order of docs/ARCHITECTURE.md's compiler section; lowering, memory planning
# and the order check follow in ``compile``. The first six change *what* is computed: they are also
# ``passes/rewrites.REWRITES``, which SBP inference and micro-batching replay on a micro-batch's job (a
# test checks the two agree).
PASSES: tuple[ModuleType, ...] = (
    autodiff,
    optimizer,
    mixed_precision,
    running_stats,
    zero,
    recompute,
    sbp_inference,
    boxing_pass,
    fusion,
    grad_buckets,
    micro_batching,
)


def pass_name(p: ModuleType) -> str:
    return p.__name__.rsplit(".", 1)[-1]


Lower = Literal["auto", "eager", "lazy", "none"]


@dataclass
class Compiled:
    state: CompileState
    plan: pp.Plan | None  # every rank's tasks; None when lowered on demand (``lazy``) or not at all
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass, in run order
    notes: list[str] = field(default_factory=list)
    memory: dict[int, DeviceMemory] = field(default_factory=dict)
    lazy: lowering.Lowered | None = None  # on demand: the representatives' walk (totals, call log)
    job_id: str = ""
    budget: CompileBudget | None = None  # what its compile and every later lowering walk may cost
    _devices: dict[int, pp.DevicePlan] = field(default_factory=dict, repr=False)
    _headers: dict[tuple[Placement, ...], bytes] = field(default_factory=dict, repr=False)  # of rank plans
    _placed: dict[int, tuple[Placement, ...]] = field(default_factory=dict, repr=False)  # ``placed_on``
    _header: pp.Plan | None = field(default=None, repr=False)  # ``header()``, kept while rank plans are made
    _memo: Memo = field(default_factory=Memo, repr=False)  # what every walk of this state shares

    def summary(self) -> str:
        return summarize(self)

    def device_plan(self, rank: int) -> pp.DevicePlan:
        """Rank ``rank``'s DevicePlan (with its memory estimate): from the plan, or lowered now (cached)."""
        if self.plan is not None:
            found = [d for d in self.plan.devices if d.rank == rank]
            if not found:
                raise LoweringError(f"rank {rank} has no tasks in this plan")
            return found[0]
        if self.lazy is None:
            raise LoweringError("this job was compiled without lowering (lower='none')")
        if rank not in self._devices:
            self._devices.update(self.device_plans([rank]))
        return self._devices[rank]

    def device_plans(self, ranks: list[int]) -> dict[int, pp.DevicePlan]:
        """Several ranks' DevicePlans lowered in one walk (not cached: a control plane ships them)."""
        return self._walk(ranks)[0]

    def _walk(self, ranks: list[int]) -> tuple[dict[int, pp.DevicePlan], dict[int, list[str]]]:
        """``device_plans`` and, for the ranks this walk built, the communicators each is a member of (every
        call on a communicator involves each of its ranks, so a built member has a task on it)."""
        todo = [r for r in ranks if r not in self._devices]
        low = lowering.lower(self.state, todo, memo=self._memo, budget=self.budget)
        for rank, d in low.devices.items():
            d.memory.CopyFrom(self.memory[rank].to_proto())
        members: dict[int, list[str]] = {}
        for c in low.communicators:
            for r in c.ranks:
                members.setdefault(r, []).append(c.id)
        return {r: self._devices.get(r) or low.devices[r] for r in ranks}, {
            r: members[r] for r in low.devices
        }

    def header(self) -> pp.Plan:
        """The whole plan's header (``lowering.plan_header``: the job and every tensor), without devices."""
        return lowering.plan_header(self.state, self.job_id)

    def rank_plan(self, rank: int) -> pp.Plan:
        """The Plan one worker needs: its DevicePlan, the communicators it is a member of, and the header's
        tables as far as they concern it — the tensors placed on it, not ``Plan.job`` (``rank_header``)."""
        return pp.Plan.FromString(self._rank_plan_bytes(self.device_plan(rank)))

    def rank_plans(self, ranks: Sequence[int], batch: int = 32) -> Iterator[tuple[int, bytes]]:
        """Each rank's serialised :meth:`rank_plan`, as a scheduler ships it to the rank's worker; a lazy
        plan is lowered ``batch`` ranks per walk (``device_plans``) and nothing is cached, so launching every
        rank of a big job holds one batch of DevicePlans at a time."""
        index = {d.rank: d for d in self.plan.devices} if self.plan is not None else {}
        for i in range(0, len(ranks), batch):
            part = list(ranks[i : i + batch])
            devices, members = ({r: index[r] for r in part}, {}) if index else self._walk(part)
            for r in part:
                yield r, self._rank_plan_bytes(devices.pop(r), members.get(r))

    def device_types(self) -> dict[int, jp.DeviceType.ValueType]:
        """Every rank with tasks (one worker each) -> its ``DeviceType``: the plan's devices or, lowered on
        demand, the ranks of the placements (those ``device_plan`` accepts), without lowering any."""
        if self.plan is not None:
            return {d.rank: d.device_type for d in self.plan.devices}
        placements = {t.placement for t in self.state.graph.tensors.values() if t.placement is not None}
        types = {pl: wire.placement_to_proto(pl).device_type for pl in placements}
        return dict(sorted((r, types[pl]) for pl in placements for r in pl.ranks))

    def _rank_plan_bytes(self, d: pp.DevicePlan, communicators: list[str] | None = None) -> bytes:
        # A parsed concatenation of messages is their merge, so the header (the same for every rank of the
        # same placements) is serialised once, and the DevicePlan is written as Plan's field 3 uncopied.
        header = self._rank_header(d.rank)
        used = {t.communicator for t in d.tasks if t.communicator} if communicators is None else communicators
        ids = sorted(used)
        comms = pp.Plan(
            communicators=[
                pp.Communicator(id=c, ranks=[int(r) for r in c.split(":", 1)[1].split(",")]) for c in ids
            ]
        )
        body = d.SerializeToString()
        return header + _DEVICES_TAG + varint(len(body)) + body + comms.SerializeToString()

    def _rank_header(self, rank: int) -> bytes:
        if not self._placed:
            self._placed = placed_on(self.state)
        key = self._placed[rank]
        if key not in self._headers:
            whole = self._header = self._header or self.header()
            self._headers[key] = rank_header(whole, self.state, frozenset(key)).SerializeToString()
        return self._headers[key]


def placed_on(state: CompileState) -> dict[int, tuple[Placement, ...]]:
    """Each rank -> the placements it is in, in the graph's order of first use."""
    pls = dict.fromkeys(t.placement for t in state.graph.tensors.values() if t.placement is not None)
    out: dict[int, list[Placement]] = {}
    for pl in pls:
        for r in pl.ranks:
            out.setdefault(r, []).append(pl)
    return {r: tuple(p) for r, p in out.items()}


def rank_header(header: pp.Plan, state: CompileState, mine: frozenset[Placement]) -> pp.Plan:
    """``header`` as a rank in the placements ``mine`` gets it: without ``Plan.job`` (the runtime never
    reads it) and with only the tensors placed on that rank (those its tasks, store and checkpoints
    read), in the header's order; every other table as it is."""
    decls = list(state.graph.tensors.values())
    assert [t.name for t in header.tensors] == [d.name for d in decls], "the header's tensors are the graph's"
    out = pp.Plan()
    out.CopyFrom(header)
    out.ClearField("job")
    del out.tensors[:]
    out.tensors.extend(t for t, d in zip(header.tensors, decls, strict=True) if d.placement in mine)
    return out


_DEVICES_TAG = bytes([pp.Plan.DEVICES_FIELD_NUMBER << 3 | 2])  # field 3, length-delimited


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint (a length prefix of a length-delimited field)."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def compile(
    job: Job,
    verify: bool = True,
    job_id: str = "",
    cluster_size: int | None = None,
    lower: bool | Lower = "auto",
    budget: CompileBudget | None = None,
) -> Compiled:
    """Compile ``job``; raise the first pass's error (it names the op, the tensors and the fix).

    ``cluster_size``, when given, is the number of devices the job may use (ranks ``0 .. cluster_size-1``);
    a placement that needs more is refused before any pass runs. ``lower``: ``"eager"`` materialises the
    whole Plan, ``"lazy"`` lowers ranks on demand (module docstring), ``"auto"`` (or ``True``) is eager up
    to ``LAZY_ABOVE`` estimated tasks, ``"none"`` (or ``False``) stops after the graph passes (no
    Plan, no memory estimate): what the compile-scale benchmark times per layer count. ``budget`` (kept on
    the Compiled for its lowering): the job is sized against its limits before the passes and before
    lowering (``plan_size``), its cancel event and deadline are looked at between passes, and every
    lowering walk counts against it; ``None``: no limits (a library call's own job).
    """
    mode: Lower = ("auto" if lower else "none") if isinstance(lower, bool) else lower
    t0 = time.perf_counter()
    if cluster_size is not None:
        check_cluster(job, cluster_size)
    if budget is not None:
        plan_size.precheck(job, budget.limits)
    state = CompileState.start(job)
    out = Compiled(state, None, {"start": time.perf_counter() - t0}, job_id=job_id, budget=budget)
    boxed = False
    for p in PASSES:
        if budget is not None:
            budget.check()
        if p is fusion:  # the attention core's fold (compiler/attention_core.py), gated by fusion alike
            _timed(out, "attention_core", attention_core.run, state)
        _timed(out, pass_name(p), p.run, state)
        boxed = boxed or p is boxing_pass
        if verify:
            _timed(out, "verify", state.graph.verify)
            if boxed:  # from boxing on, every op reads exactly what it asks for
                _timed(out, "verify", verify_compiled, state)
    out.timings["total"] = time.perf_counter() - t0
    return out if mode == "none" else finish(out, mode)


def finish(out: Compiled, lower: Lower = "auto", budget: CompileBudget | None = None) -> Compiled:
    """Lower ``out``, a job that ``compile(..., lower="none")`` left after its graph passes, on that same
    state (the passes do not run again) — what a control plane does with Submit's validation compile.
    ``lower`` as in :func:`compile`; a Compiled already lowered (or whose lowering was skipped) is returned
    as it is. Its timings go on adding up (``total`` stays last). ``budget`` (else ``out.budget``, and
    kept there): the plan is sized against its limits first (``plan_size.check``), and lowering counts
    against it."""
    if out.plan is not None or out.lazy is not None or any("lowering skipped" in n for n in out.notes):
        return out
    t0, state = time.perf_counter(), out.state
    budget = out.budget = budget or out.budget
    before = out.timings.pop("total", 0.0)
    missing = [t for t in state.graph.tensors.values() if t.placement is None or t.sbp is None]
    if missing:
        out.notes.append(
            f"lowering skipped: {len(missing)} tensor(s) (e.g. {missing[0].name!r}) have no placement or SBP and "
            "the SBP inference pass is missing; annotate every tensor or add the pass"
        )
    else:
        if budget is not None:
            plan_size.precheck(state.job, budget.limits)
            _timed(out, "plan size", plan_size.check, state, budget.limits)
        mode = ("lazy" if estimate_tasks(state) > LAZY_ABOVE else "eager") if lower == "auto" else lower
        if mode == "eager":
            out.plan = _timed(out, "lowering", lowering.run, state, out.job_id, budget)
            out.memory = _timed(out, "memory", memory.run, state, out.plan)
            _timed(out, "comm_order", comm_order.check, out.plan)
        elif mode == "lazy":
            _lazy(out)
    out.timings["total"] = before + time.perf_counter() - t0
    return out


def _lazy(out: Compiled) -> None:
    """Lower one rank per memory class, with the global call log, and check what the full plan would."""
    state = out.state
    classes = _timed(out, "rank classes", memory.rank_classes, state)
    low = _timed(out, "lowering", lowering.lower, state, [c[0] for c in classes], True, None, out.budget)
    _timed(out, "comm_order", check_order, low)
    out.memory = _timed(out, "memory", memory.for_classes, state, low.devices, classes)
    out.lazy, out._devices = low, dict(low.devices)
    out.notes.append(
        f"lowered on demand: {low.tasks} tasks on {len(out.memory)} devices; built {len(classes)} "
        "representative rank(s), one per memory class (Compiled.device_plan(rank) lowers any other)"
    )


def check_cluster(job: Job, cluster_size: int) -> None:
    """Refuse a placement that names a rank the cluster does not have, naming who uses it and the fix."""
    if cluster_size < 1:
        raise PlacementError(f"cluster_size={cluster_size}: a cluster has at least one device")
    g = job.graph
    users = [(f"tensor {t.name!r}", t.placement) for t in g.tensors.values()]
    users += [(f"op {o.name!r} ({o.op_type})", o.placement) for o in g.ops]
    for who, pl in users:
        if pl is not None and max(pl.ranks) >= cluster_size:
            raise PlacementError(
                f"{who} is placed on {pl}: {pl.size} ranks up to rank {max(pl.ranks)}, but the cluster has "
                f"{cluster_size} device(s) (ranks 0..{cluster_size - 1}); place the job on at most "
                f"{cluster_size} ranks or run it on a larger cluster"
            )


def _timed(out: Compiled, name: str, fn: Callable[..., T], *args: object) -> T:
    t = time.perf_counter()
    result = fn(*args)
    out.timings[name] = out.timings.get(name, 0.0) + time.perf_counter() - t
    return result


# ---- the text summary (``sbpflow plan``) --------------------------------------------------------


def summarize(c: Compiled) -> str:
    state, g = c.state, c.state.graph
    kernels = [o for o in g.ops if o.op_type != BOXING]
    lines = [
        f"job {state.job.name!r}: {len(kernels)} ops, {len(g.ops) - len(kernels)} boxing, {len(g.tensors)} tensors"
    ]
    lines += [f"  note: {n}" for n in c.notes]
    lines.append("passes: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in c.timings.items()))
    lines += ["", "SBP per op:", *("  " + line for line in _sbp_lines(c))]
    lines += ["", "boxing:", *("  " + line for line in _boxing_lines(state))]
    if c.plan is not None or c.lazy is not None:
        lines += ["", "plan:", *("  " + line for line in _plan_lines(c))]
    return "\n".join(lines)


def dump(c: Compiled) -> str:
    """``summarize`` without the timings and with every size in exact bytes: deterministic, so golden
    files can diff it (tests/control_plane/compiler/golden/)."""
    state, g = c.state, c.state.graph
    kernels = [o for o in g.ops if o.op_type != BOXING]
    lines = [
        f"job {state.job.name!r}: {len(kernels)} ops, {len(g.ops) - len(kernels)} boxing, {len(g.tensors)} tensors"
    ]
    lines += [f"  note: {n}" for n in c.notes]
    lines += ["", "SBP per op:", *("  " + line for line in _sbp_lines(c))]
    lines += ["", "boxing:", *("  " + line for line in _boxing_lines(state))]
    if c.plan is not None:
        lines += ["", "plan:", *("  " + line for line in _plan_lines(c, lambda n: f"{n} B"))]
    return "\n".join(lines) + "\n"


def _sbp_lines(c: Compiled) -> list[str]:
    if c.state.choices:
        return str(sbp_inference.dump(c.state)).splitlines()
    g = c.state.graph
    out = []
    for o in g.ops:
        if o.op_type == BOXING:
            continue
        ins = ", ".join(_sbp(g, t) for t in o.inputs)
        outs = ", ".join(_sbp(g, t) for t in o.outputs)
        out.append(f"{o.name} ({o.op_type}): {ins} -> {outs}")
    return out


def _sbp(g: Graph, name: str) -> str:
    t = g.tensors[name]
    return "?" if t.sbp is None else format_nd(t.sbp)


def _boxing_lines(state: CompileState) -> list[str]:
    boxes = [(o, state.boxings.get(o.name)) for o in state.graph.ops if o.op_type == BOXING]
    if not boxes:
        return ["none"]
    out = [f"{o.inputs[0]} -> {o.outputs[0]}: {p!r}" for o, p in boxes]
    total = sum(p.bytes for _, p in boxes if p is not None)
    return [*out, f"total {total} B per step"]


def _plan_lines(c: Compiled, size: Callable[[int], str] | None = None) -> list[str]:
    size = size or _size
    if c.plan is None:  # lowered on demand: totals from the walk, memory per class
        assert c.lazy is not None
        out = [
            f"{len(c.memory)} devices, {c.lazy.tasks} tasks, {c.lazy.registers} registers (lowered on demand)"
        ]
    else:
        out = [
            f"{len(c.plan.devices)} devices, {sum(len(d.tasks) for d in c.plan.devices)} tasks, "
            f"{sum(len(d.registers) for d in c.plan.devices)} registers, "
            f"{len(c.plan.communicators)} communicators"
        ]
        out += [f"communicator {cm.id}: {len(cm.order)} steps" for cm in c.plan.communicators]
    out.append("memory per device (parameters / gradients / optimizer state / peak activations = total):")
    for rank, m in c.memory.items():
        out.append(
            f"  rank {rank}: {size(m.parameters)} / {size(m.gradients)} / {size(m.optimizer_state)} / "
            f"{size(m.peak_activations)} = {size(m.total)}"
        )
    return out


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
