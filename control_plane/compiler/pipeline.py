"""The compiler driver: ``compile(job)`` runs the passes in order and lowers the result to a Plan.

    CompileState.start -> autodiff -> optimizer -> mixed_precision -> zero -> checkpointing
        -> sbp_inference -> boxing_pass -> micro_batching -> lowering -> memory
        -> comm_order.check

Each pass is a module of this package with ``run(state)``; it is imported when the pipeline runs, and a
pass whose module does not exist yet is skipped with a note (the note says when the job asked for what
the pass does). ``Graph.verify`` runs after every pass, and every pass's wall time is recorded (the
compile-scale benchmark reports them); from ``boxing_pass`` on, ``verify.verify_compiled`` runs after
every pass too (each op reads exactly the SBP its signature asks for). ``compile(job, cluster_size=N)``
first refuses a placement with a rank outside ``0 .. N-1``. Lowering needs every tensor's placement and
SBP; when the passes that provide them are missing and the job does not annotate every tensor, lowering
is skipped with a note and ``Compiled.plan`` is ``None``.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from sbpflow.control_plane.compiler import comm_order, lowering, memory
from sbpflow.control_plane.compiler.memory import DeviceMemory
from sbpflow.control_plane.compiler.state import CompileState
from sbpflow.errors import PlacementError
from sbpflow.graph import BOXING, Graph
from sbpflow.job import Job
from sbpflow.sbp import format_nd
from sbpflow.v1 import plan_pb2 as pp

PACKAGE = "sbpflow.control_plane.compiler"
T = TypeVar("T")


@dataclass(frozen=True)
class Pass:
    name: str  # module of this package
    wanted: Callable[[Job], bool] = lambda job: True  # does this job ask for what the pass does?


# The order of ARCHITECTURE.md's compiler section.
PASSES = (
    Pass("autodiff", lambda j: bool(j.loss) and j.optimizer is not None),
    Pass("optimizer", lambda j: j.optimizer is not None),
    Pass("mixed_precision", lambda j: j.config.precision.value in ("fp16", "bf16")),
    Pass("zero", lambda j: j.config.zero_stage > 0),
    Pass(
        "checkpointing", lambda j: j.config.activation_checkpointing or any(o.checkpoint for o in j.graph.ops)
    ),
    Pass("sbp_inference"),
    Pass("boxing_pass"),
    Pass("micro_batching", lambda j: j.config.micro_batches > 1 or j.config.gradient_accumulation_steps > 1),
)


@dataclass
class Compiled:
    state: CompileState
    plan: pp.Plan | None
    timings: dict[str, float] = field(default_factory=dict)  # seconds per pass, in run order
    notes: list[str] = field(default_factory=list)
    memory: dict[int, DeviceMemory] = field(default_factory=dict)

    def summary(self) -> str:
        return summarize(self)


def available(name: str) -> bool:
    return importlib.util.find_spec(f"{PACKAGE}.{name}") is not None


def compile(
    job: Job, verify: bool = True, job_id: str = "", cluster_size: int | None = None, lower: bool = True
) -> Compiled:
    """Compile ``job``; raise the first pass's error (it names the op, the tensors and the fix).

    ``cluster_size``, when given, is the number of devices the job may use (ranks ``0 .. cluster_size-1``);
    a placement that needs more is refused before any pass runs. ``lower=False`` stops after the graph
    passes (no Plan, no memory estimate): what the compile-scale benchmark times per layer count.
    """
    t0 = time.perf_counter()
    if cluster_size is not None:
        check_cluster(job, cluster_size)
    state = CompileState.start(job)
    out = Compiled(state, None, {"start": time.perf_counter() - t0})
    boxed = False
    for p in PASSES:
        if not available(p.name):
            asked = " — this job asks for it, so the plan runs without it" if p.wanted(job) else ""
            out.notes.append(f"pass {p.name}: not implemented yet, skipped{asked}")
            continue
        _timed(out, p.name, importlib.import_module(f"{PACKAGE}.{p.name}").run, state)
        boxed = boxed or p.name == "boxing_pass"
        if verify:
            _timed(out, "verify", state.graph.verify)
            if boxed and available("verify"):  # from boxing on, every op reads exactly what it asks for
                _timed(out, "verify", importlib.import_module(f"{PACKAGE}.verify").verify_compiled, state)
    if not lower:
        out.timings["total"] = time.perf_counter() - t0
        return out
    missing = [t for t in state.graph.tensors.values() if t.placement is None or t.sbp is None]
    if missing:
        out.notes.append(
            f"lowering skipped: {len(missing)} tensor(s) (e.g. {missing[0].name!r}) have no placement or SBP and "
            "the SBP inference pass is missing; annotate every tensor or add the pass"
        )
        return out
    out.plan = _timed(out, "lowering", lowering.run, state, job_id)
    out.memory = _timed(out, "memory", memory.run, state, out.plan)
    _timed(out, "comm_order", comm_order.check, out.plan)
    out.timings["total"] = time.perf_counter() - t0
    return out


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
    if c.plan is not None:
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
    if c.state.choices and available("sbp_inference"):
        dump = importlib.import_module(f"{PACKAGE}.sbp_inference").dump
        return str(dump(c.state)).splitlines()
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
    assert c.plan is not None
    out = [
        f"{len(c.plan.devices)} devices, {sum(len(d.tasks) for d in c.plan.devices)} tasks, "
        f"{sum(len(d.registers) for d in c.plan.devices)} registers, {len(c.plan.communicators)} communicators"
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
