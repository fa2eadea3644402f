"""The bounds on every number and name a job carries, in one table, and the check that applies them.

A job is untrusted input at Submit: anything the compiler or a worker does in proportion to a number
the user chose (a stage, a step count, a shape, a name written into every store row and metric label)
must be bounded before that work starts. :class:`Limits` is the table (a server may pass its own); :func:`check_graph`
(and ``sbpflow.data.checks.check_data``) walk a job's graph and data source and raise :class:`LimitError` at the first value
outside it, naming the field, the value, the limit and the fix (``sbpflow.job.check_job`` walks the rest of
a job with the same helpers, as part of ``Job.verify``). ``sbpflow.codec.wire`` calls the same helpers while it
converts a protobuf (a shape is checked before numpy multiplies it out).

Every check here is cheap: linear in the size of the job message, never in a number inside it.

The compile's own work grows with numbers inside the job (ops x micro-batches x stages x ranks): the
compiler estimates it from the compiled graph before lowering (``compiler/plan_size.py``: refused over
the ``Limits``' plan fields with :class:`CompileLimitError`), and a :class:`CompileBudget` (cancel event,
deadline, counters of what one lowering walk built) is checked inside the loops that grow with them, so
a compile stops within a few thousand tasks of its limit or of a cancel (:class:`CompileCancelled`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sbpflow.errors import SbpflowError

if TYPE_CHECKING:
    from sbpflow.graph import Graph
    from sbpflow.placement import Placement


class LimitError(SbpflowError, ValueError):
    """A job value outside :class:`Limits` (or not finite); ``field`` names where it is."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Limits:
    """The largest value each kind of job field may take (the smallest is in the check that uses it)."""

    name_chars: int = 256  # job, tensor, op, field, parameter names; op types, scopes, attribute keys
    path_chars: int = 4096  # data file paths
    text_chars: int = 4096  # string attribute values
    steps: int = 10**9  # JobConfig.steps, checkpoint_every, schedule steps
    stage: int = 1023  # OpNode.stage: pipeline stages 0 .. 1023
    micro_batches: int = 1 << 16  # gradient_accumulation_steps x micro_batches
    rank: int = (1 << 16) - 1  # placement ranks 0 .. 65535
    mesh_axes: int = 8  # axes of a placement's mesh (and entries of an nd-SBP)
    ndim: int = 32  # axes of a tensor
    numel: int = 1 << 48  # elements of one tensor (x 8 bytes stays far from int64's 2**63)
    batch_size: int = 1 << 31
    samples: int = 1 << 48  # a synthetic source's num_samples
    list_items: int = 1 << 16  # entries of an int or float list attribute
    count: int = 1 << 20  # tensors, ops, parameters, fetches, data fields, arrays, files of one job
    magnitude: float = 1e30  # any float hyper-parameter or attribute (|x|), besides being finite
    int_attr: int = 1 << 62  # |x| of an integer attribute
    # what compiling a job may cost the control plane (``compiler/plan_size.py``, :class:`CompileBudget`);
    # a task costs the control plane ~2 KB while built and ~50-100 us to build (measured on GPT, 1F1B)
    pipeline_slots: int = 1 << 17  # stages x micro-batches (the schedule holds twice as many actions)
    walk_steps: int = 1 << 22  # op emissions of one lowering walk: ~ compiled ops x micro-batches
    rank_tasks: int = 1 << 18  # tasks of one rank's DevicePlan
    rank_registers: int = 1 << 19  # registers of one rank's DevicePlan
    plan_bytes: int = 1 << 28  # one rank's serialised DevicePlan, estimated
    plan_tasks: int = 1 << 26  # every rank's tasks together (a big job is lowered a few ranks at a time)
    built_tasks: int = 1 << 20  # tasks one lowering walk may build: what the control plane holds at once
    compile_seconds: float = 3600.0  # a job's compile and lowering, wall clock


LIMITS = Limits()


class CompileLimitError(LimitError):
    """A compile over its :class:`Limits` (estimated before lowering, or counted while lowering): the job
    ends FAILED with this ``reason``."""

    reason = "COMPILE_LIMIT"


class CompileCancelled(SbpflowError):
    """The compile's cancel event was set (a launch turns it into its ``RunCancelled``)."""


@dataclass
class CompileBudget:
    """One compile's budget, checked cooperatively by the loops that grow with the job's numbers: a cancel
    event, a wall-clock deadline, and counters of the tasks, registers and walk steps the current
    lowering walk made (:meth:`walk` starts a walk's counters again; the deadline spans every walk)."""

    limits: Limits = LIMITS
    cancel: threading.Event | None = None
    deadline: float = math.inf  # time.monotonic()
    tasks: int = 0
    registers: int = 0
    steps: int = 0
    _due: int = 0  # steps + tasks at which the clock and the event are next looked at

    EVERY = 1024  # how often (steps and tasks made) the clock and the cancel event are looked at

    @classmethod
    def start(cls, limits: Limits = LIMITS, cancel: threading.Event | None = None) -> CompileBudget:
        return cls(limits, cancel, time.monotonic() + limits.compile_seconds)

    def walk(self) -> None:
        self.tasks = self.registers = self.steps = self._due = 0
        self.check()

    def check(self) -> None:
        """Raise :class:`CompileCancelled` once the event is set, :class:`CompileLimitError` past the deadline."""
        if self.cancel is not None and self.cancel.is_set():
            raise CompileCancelled("the compile was cancelled")
        if time.monotonic() > self.deadline:
            raise over_budget(
                "compile_seconds", self.limits.compile_seconds, "the compile ran past its time limit"
            )

    def made(self, tasks: int = 0, registers: int = 0, steps: int = 0) -> None:
        """Count what a walk made; raise when a count passes its limit (and now and then :meth:`check`)."""
        self.tasks += tasks
        self.registers += registers
        self.steps += steps
        lim = self.limits
        if self.tasks > lim.built_tasks:
            raise over_budget("built_tasks", lim.built_tasks, f"one lowering walk built {self.tasks} tasks")
        if self.registers > 2 * lim.built_tasks:
            raise over_budget(
                "built_tasks",
                lim.built_tasks,
                f"one lowering walk built {self.registers} registers (2 a task)",
            )
        if self.steps > lim.walk_steps:
            raise over_budget("walk_steps", lim.walk_steps, f"one lowering walk took {self.steps} steps")
        if self.steps + self.tasks >= self._due:
            self._due = self.steps + self.tasks + self.EVERY
            self.check()


FEWER = (
    "use fewer micro-batches (micro_batches x gradient_accumulation_steps), fewer pipeline stages, ranks "
    "or layers, or ask the server's operator to raise its limit"
)


def over_budget(quantity: str, limit: float, what: str, fix: str = FEWER) -> CompileLimitError:
    """The error for a compile over ``Limits.<quantity>``: what it is, the limit and the fix."""
    return CompileLimitError(
        f"{what}, over the limit of {limit:,} (Limits.{quantity}); {fix}", field=quantity
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def refuse(where: str, value: Any, problem: str, fix: str) -> LimitError:
    """The error for ``where=value``: what is wrong (with the limit) and the fix."""
    return LimitError(f"{where}={_shown(value)}: {problem}; {fix}", field=where)


# ---- the checks, one per kind of value ------------------------------------------------------------


def check_int(where: str, value: Any, lo: int, hi: int, fix: str = "") -> int:
    """An int (never a bool) in ``lo .. hi``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse(where, value, "must be an integer", fix or f"give an integer in {lo}..{hi}")
    if not lo <= value <= hi:
        raise refuse(where, value, f"is outside {lo}..{hi}", fix or f"give a value in {lo}..{hi}")
    return value


def check_float(
    where: str, value: Any, lo: float = -LIMITS.magnitude, hi: float = LIMITS.magnitude, fix: str = ""
) -> float:
    """A finite float in ``[lo, hi]`` (NaN and infinities are refused everywhere)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse(where, value, "must be a number", fix or f"give a finite number in [{lo:g}, {hi:g}]")
    if not math.isfinite(value):
        raise refuse(where, value, "is not finite", fix or f"give a finite number in [{lo:g}, {hi:g}]")
    if not lo <= value <= hi:
        raise refuse(where, value, f"is outside [{lo:g}, {hi:g}]", fix or f"give a value in [{lo:g}, {hi:g}]")
    return float(value)


def check_whole(where: str, value: float, lo: int, hi: int) -> int:
    """A float that carries an integer (a synthetic source's sizes): finite, whole, in ``lo .. hi``."""
    check_float(where, value, lo, hi, f"give a whole number in {lo}..{hi}")
    if value != int(value):
        raise refuse(where, value, "is not a whole number", f"give a whole number in {lo}..{hi}")
    return int(value)


def check_name(where: str, value: Any, limits: Limits = LIMITS, empty: bool = False, chars: int = 0) -> str:
    """A printable string of at most ``chars`` (default ``limits.name_chars``) characters, non-empty
    unless ``empty``."""
    chars = chars or limits.name_chars
    if not isinstance(value, str):
        raise refuse(where, value, "must be a string", "give a printable name")
    if len(value) > chars:
        raise refuse(
            where, value, f"is {len(value)} characters, over the limit of {chars}", "use a shorter name"
        )
    if not value and not empty:
        raise refuse(where, value, "is empty", "give a non-empty name")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise refuse(
            where, value, f"holds the unprintable character {bad!r}", "use printable characters only"
        )
    return value


def check_count(where: str, items: Any, limits: Limits = LIMITS, most: int = 0) -> None:
    most = most or limits.count
    if len(items) > most:
        raise refuse(
            where, f"<{len(items)} entries>", f"has more than {most} entries", "make the job smaller"
        )


def check_shape(where: str, shape: Any, limits: Limits = LIMITS) -> tuple[int, ...]:
    """At most ``limits.ndim`` sizes, each >= 0, whose product is at most ``limits.numel`` (computed on
    Python ints, so it never wraps as an int64 product does)."""
    shape = tuple(shape)
    if len(shape) > limits.ndim:
        raise refuse(
            where, shape, f"has {len(shape)} axes, over the limit of {limits.ndim}", "use fewer axes"
        )
    numel = 1
    for i, d in enumerate(shape):
        check_int(f"{where}[{i}]", d, 0, limits.numel, f"give a size in 0..{limits.numel}")
        numel *= d
    if numel > limits.numel:
        raise refuse(
            where,
            list(shape),
            f"holds {numel} elements, over the limit of {limits.numel}",
            "use smaller sizes",
        )
    return shape


def check_placement(where: str, p: Placement, limits: Limits = LIMITS) -> None:
    """Ranks in ``0 .. limits.rank`` on at most ``limits.mesh_axes`` axes (``Placement`` itself refuses
    repeated ranks and a mesh that does not hold them)."""
    if p.ndim > limits.mesh_axes:
        raise refuse(
            f"{where}.mesh_shape", list(p.shape), f"has over {limits.mesh_axes} axes", "use a smaller mesh"
        )
    top = max(p.ranks)
    if top > limits.rank:
        raise refuse(
            f"{where}.ranks",
            top,
            f"is over the largest rank {limits.rank}",
            "use ranks 0.. the cluster's size",
        )


def check_attr(where: str, value: Any, limits: Limits = LIMITS) -> None:
    """An op attribute: bounded ints, finite floats, printable strings, bounded lists."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        check_int(where, value, -limits.int_attr, limits.int_attr)
    elif isinstance(value, float):
        check_float(where, value, -limits.magnitude, limits.magnitude)
    elif isinstance(value, str):
        check_name(where, value, limits, empty=True, chars=limits.text_chars)
    elif isinstance(value, tuple):
        check_count(where, value, limits, limits.list_items)
        for i, v in enumerate(value):
            check_attr(f"{where}[{i}]", v, limits)


# ---- the graph and the data ------------------------------------------------------------------------


def check_graph(g: Graph, limits: Limits = LIMITS) -> None:
    check_count("job.graph.tensors", g.tensors, limits)
    check_count("job.graph.ops", g.ops, limits)
    for name, t in g.tensors.items():
        where = f"tensor {name[:40]!r}"
        check_name(f"{where}.name", name, limits)
        check_shape(f"{where}.shape", t.meta.shape, limits)
        if t.placement is not None:
            check_placement(f"{where}.placement", t.placement, limits)
    for node in g.ops:
        where = f"op {node.name[:40]!r}"
        check_name(f"{where}.name", node.name, limits)
        check_name(f"{where}.op_type", node.op_type, limits)
        check_name(f"{where}.scope", node.scope, limits, empty=True, chars=limits.text_chars)
        check_int(f"{where}.stage", node.stage, 0, limits.stage, f"number pipeline stages 0..{limits.stage}")
        for names, what in ((node.inputs, "inputs"), (node.outputs, "outputs")):
            check_count(f"{where}.{what}", names, limits, limits.list_items)
        check_count(f"{where}.attrs", node.attrs, limits, limits.list_items)
        for key, value in node.attrs.items():
            check_name(f"{where}.attrs key", key, limits)
            check_attr(f"{where}.attrs[{key!r}]", value, limits)
        if node.placement is not None:
            check_placement(f"{where}.placement", node.placement, limits)
