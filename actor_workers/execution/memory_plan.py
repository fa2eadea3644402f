"""A static memory plan for one rank: registers whose lifetimes do not overlap share a buffer (OneFlow's
memory reuse).

Lifetimes come from the plan's compute order: a register's value of a step lives from its producer's
position in the rank's task list to its last consumer's (both included, so a kernel's input never shares
with its output). Registers are coloured first-fit in decreasing byte size (:func:`colour`): a register
goes into the first buffer ("slab") none of whose registers' lifetimes overlap its own, else a new slab
of its size. Each register gets one view of its slab, of its local shape and dtype, made once; its
producer is lent that view through ``out_buffers`` (``KernelContext.out_array``), like
:class:`~.tasks.OutputReuse` lends a kernel its own previous output.

The engine's order is dynamic (a step's forward may start while the last one's backward runs), so the
plan decides only who *may* share; a slab is lent at run time only when it is dead (:meth:`Slab.free`):

* every consumer of the value it holds has acted on it (a count the consumers' acts bring down:
  :func:`watch`), and none returned that very array as an output (an identity passes the value on under
  the same object) or an array on its memory that does not refer to the slab's owner (numba's view of
  an input, an array on a memoryview: :func:`untracked`): the slab is then retired for good;
* and no array but the plan's own views refers to its memory (CPython's refcount of the slab's owner:
  every view of it, a consumer's reshape or slice included, refers to the owner in numpy).

A slab that is not free is not lent, and the kernel allocates a fresh array: two live values in one
buffer cannot happen, whatever the order. Only registers that nobody keeps past an act are planned: one
slot, produced by a kernel on the compute stream, read only by kernels and updates there (a SINK fetch
records its value, an assign stores it, a boxing may send it), directly or through boxing steps that
move nothing, which the executor bypasses (:func:`reach`: BERT's 2-d boxings on a 1 x 1 mesh). The executor's engine keeps no value
past its readers (``Engine(keep_last=())``), so a value's references are its readers' and its views'.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.actor_workers.execution.tasks import Act, OutputReuse, coord_index, local_shape
from sbpflow.graph import TensorDecl
from sbpflow.ops.base import get_op
from sbpflow.v1 import plan_pb2 as pp

PRODUCERS = (pp.TASK_KIND_KERNEL,)
# readers that never keep an input past their act (their outputs are checked for the input itself)
READERS = (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER)
# Ops whose output is a view of an input though their OpDef says nothing (``view`` is the cost model's
# flag): the main job's transposes and splits handed on 4.0 and 1.5 MB of views a step. A view op's output
# has no bytes of its own, and the engine's register of the view holds its input's bytes into the next
# step: neither is planned (any other reader that makes a view is found at run time: Planned.viewed).
VIEW_OPS = frozenset({"transpose", "split"})


def makes_views(task: pp.Task) -> bool:
    return task.kind == pp.TASK_KIND_KERNEL and (task.op_type in VIEW_OPS or get_op(task.op_type).view)


@dataclass(frozen=True)
class Lifetime:
    """A register's value within a step: from its producer's position to its last consumer's.
    ``readers``: the tasks that read the value (through pass-through steps), ``aliases``: the registers
    of those steps, which carry the same value (0 and () for a register read directly only)."""

    register: int
    nbytes: int
    first: int
    last: int
    readers: int = 0
    aliases: tuple[int, ...] = ()

    def overlaps(self, other: Lifetime) -> bool:
        return self.first <= other.last and other.first <= self.last


def colour(lifetimes: Sequence[Lifetime]) -> tuple[dict[int, int], list[int]]:
    """Register -> slab, and each slab's bytes: first-fit in decreasing size (ties by birth), a register
    into the first slab whose registers all live apart from it (a slab is as large as its first, largest
    register)."""
    slab_of: dict[int, int] = {}
    sizes: list[int] = []
    members: list[list[Lifetime]] = []
    for life in sorted(lifetimes, key=lambda x: (-x.nbytes, x.first, x.register)):
        i = next((i for i, held in enumerate(members) if not any(life.overlaps(o) for o in held)), len(sizes))
        if i == len(sizes):
            sizes.append(life.nbytes)
            members.append([])
        members[i].append(life)
        slab_of[life.register] = i
    return slab_of, sizes


def lifetimes(
    device: pp.DevicePlan,
    tensors: Mapping[str, TensorDecl],
    excluded: frozenset[int] = frozenset(),
    through: Collection[int] = (),
) -> list[Lifetime]:
    """The lifetimes of the registers of ``device`` that may share (see the module docstring), in the
    plan's task order; producers in ``excluded`` (a kernel whose output loops to the next step) are left
    out. ``through``: boxing steps that move nothing (:func:`~.executor_analysis.no_op_boxings`), which
    the executor bypasses: their readers read the value itself, and count as its readers."""
    position = {t.id: i for i, t in enumerate(device.tasks)}
    by_id = {t.id: t for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    passes = frozenset(through)
    out = []
    for reg in device.registers:
        producer = by_id.get(reg.producer_task)
        readers, aliases, steps = reach(reg, regs, by_id, passes)
        if (
            reg.count != 1
            or reg.tensor not in tensors  # a boxing's intermediate value: not a tensor of the plan
            or not readers
            or producer is None
            or producer.id in excluded
            or producer.kind not in PRODUCERS
            or producer.stream != pp.STREAM_KIND_COMPUTE
            or any(r is None or r.kind not in READERS or r.stream != pp.STREAM_KIND_COMPUTE for r in readers)
            or makes_views(producer)
            or any(makes_views(r) for r in readers if r is not None)
        ):
            continue
        shape, dtype = value_shape(tensors[reg.tensor], producer)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        last = max(position[t.id] for t in [*readers, *steps] if t is not None)
        if nbytes:
            out.append(Lifetime(reg.id, nbytes, position[producer.id], last, len(readers), aliases))
    return out


def reach(
    reg: pp.RegisterDesc,
    regs: Mapping[int, pp.RegisterDesc],
    by_id: Mapping[int, pp.Task],
    passes: frozenset[int],
) -> tuple[list[pp.Task | None], tuple[int, ...], list[pp.Task]]:
    """Who reads ``reg``'s value: its readers, a pass-through step's (in ``passes``: one input, one
    one-slot output) in place of the step; the registers of those steps; and the steps."""
    readers: dict[int, pp.Task | None] = {}  # by task id: a reader through two paths reads once
    aliases: list[int] = []
    steps: list[pp.Task] = []
    todo = [reg]
    while todo:
        for c in dict.fromkeys(todo.pop().consumer_tasks):
            t = by_id.get(c)
            if t is not None and t.id in passes and len(t.in_registers) == len(t.out_registers) == 1:
                carried = regs[t.out_registers[0]]
                if carried.count == 1:
                    steps.append(t)
                    aliases.append(carried.id)
                    todo.append(carried)
                    continue
            readers[c] = t
    return list(readers.values()), tuple(aliases), steps


def value_shape(decl: TensorDecl, producer: pp.Task) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """This rank's local shape and dtype of ``decl``, written by ``producer`` at its mesh coordinate."""
    assert decl.placement is not None
    shape = local_shape(coord_index(decl, decl.placement.shape, tuple(producer.coord)))
    return shape, np.dtype(decl.meta.dtype.to_numpy())


class Slab:
    """One buffer of the plan: its owner array, the value it holds and how many reads that value awaits."""

    __slots__ = ("base", "expected", "holder", "pending", "retired")

    def __init__(self, nbytes: int) -> None:
        self.base = np.empty(nbytes, np.uint8)
        self.expected = 0  # the owner's refcount with only the plan's views alive (set once they are made)
        self.pending = 0  # reads the value it holds still awaits
        self.retired = False  # a reader passed the value on as its own output: never lent again
        self.holder: Planned | None = None  # the register last lent it

    def free(self) -> bool:
        if self.pending or self.retired:
            return False
        if sys.getrefcount(self.base) <= self.expected:
            return True
        # Read, but something still refers to its memory: a view of the value (made by a reader, or by
        # a reader of a view), which lives until the view's own readers have acted. The register that
        # wrote it leaves the plan, so that the slab serves the others from then on.
        if self.holder is not None:
            self.holder.viewed = True
        return False

    def view(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.base[:n].view(dtype).reshape(shape)


class Planned:
    """A register of the plan: its slab, its view of it, and the reads each value awaits. ``viewed``: a
    reader passed on a view of its value (a reshape, a transpose), which lives past the value's planned
    lifetime, until the view's own readers act: the register then leaves the plan (its producer
    allocates), so that its slab is not held past its plan for every register in it."""

    __slots__ = ("readers", "slab", "view", "viewed")

    def __init__(self, slab: Slab, view: Any, readers: int) -> None:
        self.slab = slab
        self.view = view
        self.readers = readers
        self.viewed = False


class MemoryPlan:
    """One rank's plan: per planned register its :class:`Planned`; built by :func:`plan`."""

    def __init__(self, registers: dict[int, Planned], sizes: list[int], total: int) -> None:
        self.registers = registers
        self.slab_bytes = sum(sizes)  # what the slabs hold
        self.planned_bytes = total  # what the planned registers' values would hold, one array each

    def lender(self, outputs: Sequence[int], reuse: OutputReuse | None) -> Lender | None:
        """What lends the producer of ``outputs`` its buffers: slabs where planned, else ``reuse``."""
        planned = tuple(self.registers.get(r) for r in outputs)
        if not any(planned):
            return None
        return Lender(planned, reuse)


def plan(
    device: pp.DevicePlan,
    tensors: Mapping[str, TensorDecl],
    excluded: frozenset[int],
    through: Collection[int] = (),
) -> MemoryPlan:
    """The memory plan of ``device``'s registers (producers in ``excluded`` left out; ``through``: the
    pass-through steps, whose registers share their input's :class:`Planned`)."""
    lives = lifetimes(device, tensors, excluded, through)
    slab_of, sizes = colour(lives)
    slabs = [Slab(n) for n in sizes]
    regs = {r.id: r for r in device.registers}
    by_id = {t.id: t for t in device.tasks}
    out = {}
    for life in lives:
        reg = regs[life.register]
        slab = slabs[slab_of[life.register]]
        shape, dtype = value_shape(tensors[reg.tensor], by_id[reg.producer_task])
        out[reg.id] = Planned(slab, slab.view(shape, dtype), life.readers)
        for alias in life.aliases:  # read as the value itself once the step is bypassed
            out[alias] = out[reg.id]
    for slab in slabs:  # the owner's count with the plan's views alive, as free() reads it (an argument)
        slab.expected = sys.getrefcount(slab.base)
    return MemoryPlan(out, sizes, sum(life.nbytes for life in lives))


class Lender:
    """A producer's buffers: each planned output's view when its slab is free (else None: the kernel
    allocates), the other outputs' from :class:`~.tasks.OutputReuse` (its own previous value)."""

    __slots__ = ("lent", "planned", "reuse")

    def __init__(self, planned: tuple[Planned | None, ...], reuse: OutputReuse | None) -> None:
        self.planned = planned
        self.reuse = reuse
        self.lent: tuple[Any, ...] = ()

    def take(self) -> tuple[Any, ...]:
        own = self.reuse.take() if self.reuse is not None else (None,) * len(self.planned)
        self.lent = tuple(
            own[i] if p is None else (p.view if not p.viewed and p.slab.free() else None)
            for i, p in enumerate(self.planned)
        )
        return self.lent

    def keep(self, results: Sequence[Any], inputs: Sequence[Any]) -> None:
        if self.reuse is not None:
            self.reuse.keep(
                [None if p is not None else r for p, r in zip(self.planned, results, strict=True)], inputs
            )
        for i, lent in enumerate(self.lent):
            p = self.planned[i]
            if p is None or lent is None:
                continue
            p.slab.holder = p
            for j, r in enumerate(results):
                if r is p.view and i == j:  # the kernel wrote into the lent view: the slab holds its value
                    p.slab.pending = p.readers
                elif r is p.view:
                    p.slab.retired = True
                else:
                    untracked(r, p.slab)
        self.lent = ()


def untracked(value: Any, slab: Slab) -> None:
    """Retires ``slab`` if ``value`` is on its memory through something other than its owner: numba's
    view of an input (its base a numba MemInfo) or an array on a memoryview holds the slab's memory
    without the owner's count showing it. An array that owns its memory (base None) is on no slab."""
    held = getattr(value, "base", None)
    if held is not None and held is not slab.base and np.may_share_memory(value, slab.base):
        slab.retired = True


def watch(act: Act, reads: Sequence[tuple[int, Planned]]) -> Act:
    """``act`` (a reader of planned registers, at positions of its values), counting its reads of the
    values slabs hold; a slab whose value it returns as its own output is retired, a register whose value
    it returns a view of leaves the plan (:class:`Planned`)."""
    watched = tuple(reads)

    def watching(step: int, values: list[Any]) -> list[Any]:
        outs = act(step, values)
        for position, p in watched:
            if values[position] is p.view:
                for o in outs:
                    if o is p.view:
                        p.slab.retired = True
                    elif getattr(o, "base", None) is p.slab.base:
                        p.viewed = True
                    else:
                        untracked(o, p.slab)
                p.slab.pending -= 1
        return outs

    return watching
