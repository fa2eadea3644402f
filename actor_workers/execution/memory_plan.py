"""A static memory plan for one rank: registers whose lifetimes do not overlap share a buffer (OneFlow's
memory reuse).

Lifetimes come from the plan's compute order: a register's value of a step lives from its producer's
position in the rank's task list to its last consumer's (both included, so a kernel's input never shares
with its output); a consumer that makes a view of it (a reshape, a transpose, a split: :func:`makes_views`)
extends it to the last reader of the view, down chains of views (:func:`follow`). Each register gets
its place in one arena, registers whose lifetimes overlap on bytes apart (:func:`~.memory_pack.pack`,
greedy by size): its "slab", an array of its own on the arena's bytes, which registers that never live
together share in whole or in part. Each register gets one view of its slab, of its local shape and
dtype, made once; its producer is lent that view through ``out_buffers`` (``KernelContext.out_array``),
like :class:`~.tasks.OutputReuse` lends a kernel its own previous output.

The engine's order is dynamic (a step's forward may start while the last one's backward runs), so the
plan decides only who *may* share; a slab is lent at run time only when it is dead, and every slab
whose bytes meet its own too (:meth:`Slab.free`):

* every consumer of the value it holds, and every reader of a view of it, has acted on it (a count their
  acts bring down: :func:`watch`; a view op that copied, as a reshape of a transpose does, takes its
  readers' reads off), and none returned that very array as an output (an identity passes the value on under
  the same object) or an array on its memory that does not refer to the slab's owner (numba's view of
  an input, an array on a memoryview but the plan's slabs: :func:`untracked`): the slab is then retired for good;
* and no array but the plan's own views refers to its memory (CPython's refcount of the slab's owner:
  every view of it, a consumer's reshape or slice included, refers to the owner in numpy). A view alive
  once every planned read is done is one nobody expected: its register leaves the plan (``viewed``).

A slab that is not free is not lent, and the kernel allocates a fresh array: two live values on one
byte cannot happen, whatever the order. Only registers that nobody keeps past an act are planned: one
slot, produced by a kernel on the compute stream, read only by kernels and updates there (a SINK fetch
records its value, an assign stores it, a boxing may send it), directly, through boxing steps that
move nothing, which the executor bypasses (:func:`reach`: BERT's 2-d boxings on a 1 x 1 mesh), or
through views whose registers are read the same way (a view that escapes leaves its value out). The executor's engine keeps no value
past its readers (``Engine(keep_last=())``), so a value's references are its readers' and its views'.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from sbpflow.actor_workers.execution.memory_pack import ALIGN, Lifetime, meeting, pack
from sbpflow.actor_workers.execution.tasks import Act, OutputReuse, coord_index, local_shape
from sbpflow.graph import TensorDecl
from sbpflow.ops.base import get_op
from sbpflow.v1 import plan_pb2 as pp

PRODUCERS = (pp.TASK_KIND_KERNEL,)
# readers that never keep an input past their act (their outputs are checked for the input itself)
READERS = (pp.TASK_KIND_KERNEL, pp.TASK_KIND_OPTIMIZER)
# Ops whose output is a view of an input though their OpDef says nothing (``view`` is the cost model's
# flag): the main job's transposes and splits. A view op's output has no bytes of its own: it is not
# planned, but the value it views is, for as long as the view's readers read it (:func:`follow`; a
# reader that makes a view it was not expected to is found at run time: Planned.viewed).
VIEW_OPS = frozenset({"transpose", "split"})
# Plan the values that readers view (False: leave them out, as before; the A/B of bench/models/peak_memory.py
# --plan-views off)
PLAN_VIEWS = True


def makes_views(task: pp.Task) -> bool:
    return task.kind == pp.TASK_KIND_KERNEL and (task.op_type in VIEW_OPS or get_op(task.op_type).view)


def lifetimes(
    device: pp.DevicePlan,
    tensors: Mapping[str, TensorDecl],
    excluded: frozenset[int] = frozenset(),
    through: Collection[int] = (),
) -> list[Lifetime]:
    """The lifetimes of the registers of ``device`` that may share (see the module docstring), in the
    plan's task order; producers in ``excluded`` (a kernel whose output loops to the next step) are left
    out. ``through``: boxing steps that move nothing (:func:`~.executor_analysis.no_op_boxings`), which
    the executor bypasses: their readers read the value itself, and count as its readers. A reader that
    makes views (:func:`makes_views`) extends the value's lifetime to its views' last reader
    (:func:`follow`); a value whose views escape is left out."""
    position = {t.id: i for i, t in enumerate(device.tasks)}
    by_id = {t.id: t for t in device.tasks}
    regs = {r.id: r for r in device.registers}
    passes = frozenset(through)
    out = []
    for reg in device.registers:
        producer = by_id.get(reg.producer_task)
        if (
            reg.count != 1
            or reg.tensor not in tensors  # a boxing's intermediate value: not a tensor of the plan
            or producer is None
            or producer.id in excluded
            or producer.kind not in PRODUCERS
            or producer.stream != pp.STREAM_KIND_COMPUTE
            or makes_views(producer)
        ):
            continue
        followed = follow(reg, regs, by_id, passes, excluded)
        if followed is None or not followed.reads:
            continue
        shape, dtype = value_shape(tensors[reg.tensor], producer)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        first, last = position[producer.id], max(position[t] for t in followed.tasks)
        if nbytes:
            out.append(
                Lifetime(reg.id, nbytes, first, last, followed.reads, followed.aliases, followed.views)
            )
    return out


@dataclass(frozen=True)
class Followed:
    """What reads a value, through pass-through steps and views: ``reads`` its reads and its views' (a
    reader counts once a register it reads), ``tasks`` the readers' and steps' ids (the lifetime's end),
    ``aliases`` the pass-through steps' registers of the value, ``views`` (register, reads of it and of
    its own views) for each register of a view of it (and its pass-through steps' registers)."""

    reads: int
    tasks: tuple[int, ...]
    aliases: tuple[int, ...]
    views: tuple[tuple[int, int], ...]


def follow(
    reg: pp.RegisterDesc,
    regs: Mapping[int, pp.RegisterDesc],
    by_id: Mapping[int, pp.Task],
    passes: frozenset[int],
    excluded: frozenset[int] = frozenset(),
) -> Followed | None:
    """Who reads ``reg``'s value and the views its readers make of it (``VIEW_OPS``, an OpDef's
    ``view``), down every chain of views (a reshape of a transpose); None where a reader or a view
    escapes: a reader that is not a kernel or an update on the compute stream (a SINK fetches or stores
    it, a boxing sends it), a view register of more than one slot, or a view made by a kernel that reads
    something else too (``pack``) or whose output loops to the next step (``excluded``). Each view keeps
    the value's bytes until its own readers have acted."""
    readers, aliases, steps = reach(reg, regs, by_id, passes)
    if any(r is None or r.kind not in READERS or r.stream != pp.STREAM_KIND_COMPUTE for r in readers):
        return None
    reads = len(readers)
    tasks = [t.id for t in [*readers, *steps] if t is not None]
    views: list[tuple[int, int]] = []
    for r in readers:
        if r is None or not makes_views(r):
            continue
        if not PLAN_VIEWS or r.id in excluded or len(set(r.in_registers)) != 1:
            return None
        for w in dict.fromkeys(r.out_registers):
            view = regs[w]
            below = follow(view, regs, by_id, passes, excluded) if view.count == 1 else None
            if below is None:
                return None
            reads += below.reads
            tasks += below.tasks
            views += [(w, below.reads), *((a, below.reads) for a in below.aliases), *below.views]
    return Followed(reads, tuple(tasks), aliases, tuple(views))


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
    """A register's bytes in the plan: its owner array (``base``: on the arena's bytes, or of its own), the
    value it holds and how many reads that value awaits; ``meets``: the slabs whose bytes meet its own,
    each of which must be dead too before it is lent (``occupied``: it may hold a live value)."""

    __slots__ = ("base", "expected", "holder", "meets", "occupied", "pending", "retired", "siblings")

    def __init__(self, nbytes: int, base: Any = None) -> None:
        # an owner of its own on the arena's bytes (its base a memoryview, which numpy's views of it do not
        # see through), so that its refcount counts the views of this slab alone
        self.base = np.empty(nbytes, np.uint8) if base is None else base
        self.meets: tuple[Slab, ...] = ()
        self.occupied = False
        self.expected = 0  # the owner's refcount with only the plan's views alive (set once they are made)
        self.pending = 0  # reads the value it holds still awaits
        self.retired = False  # a reader passed the value on as its own output: never lent again
        self.holder: Planned | None = None  # the register last lent it
        # id() of every slab's owner in its plan (set by :func:`plan`): an array on one of them is on memory
        # of its own, never this slab's (:func:`untracked` asks numpy only about other arrays)
        self.siblings: frozenset[int] = frozenset()

    def free(self) -> bool:
        """Dead, and so is every slab whose bytes meet its own."""
        return self.dead() and all(not s.occupied or s.dead() for s in self.meets)

    def dead(self) -> bool:
        """Whether the value it holds is dead: every read done, no array but the plan's on its memory."""
        if self.pending or self.retired:
            return False
        if sys.getrefcount(self.base) <= self.expected:
            self.occupied = False  # for good: a dead value gets no reader, nor view, again
            return True
        # Every planned read done (its views' too), but something still refers to its memory: a view
        # nobody expected, which may live on. The register that wrote it leaves the plan, so that the
        # slab serves the others from then on.
        if self.holder is not None:
            self.holder.viewed = True
        return False

    def view(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.base[:n].view(dtype).reshape(shape)


class Planned:
    """A register of the plan: its slab, its view of it, and the reads each value awaits (its views'
    included). ``viewed``: a reader passed on a view of its value that the plan did not expect (not a
    view op's, or outside a view op's planned outputs), which may live past the value's planned lifetime:
    the register then leaves the plan (its producer allocates), so that its slab is not held past its
    plan for every register in it."""

    __slots__ = ("readers", "slab", "view", "viewed")

    def __init__(self, slab: Slab, view: Any, readers: int) -> None:
        self.slab = slab
        self.view = view
        self.readers = readers
        self.viewed = False


class MemoryPlan:
    """One rank's plan: per planned register its :class:`Planned`; built by :func:`plan`."""

    def __init__(
        self,
        registers: dict[int, Planned],
        arena: int,
        total: int,
        views: dict[int, tuple[Planned, int]] | None = None,
        owners: frozenset[int] = frozenset(),
    ) -> None:
        self.registers = registers
        self.owners = owners  # id() of the slabs' owners (Slab.siblings)
        self.views = views or {}  # a view's register -> the viewed register's Planned, the reads below it
        self.slab_bytes = arena  # the arena's bytes, which the slabs are on
        self.planned_bytes = total  # what the planned registers' values would hold, one array each

    def reads(self, inputs: Sequence[int], outputs: Sequence[int]) -> list[Read]:
        """What :func:`watch` counts for an actor reading ``inputs`` and writing ``outputs``: each planned
        value it reads, and each view of one, with the reads below each of its outputs that is a planned
        view of that value (None for the others)."""
        out = []
        for i, r in enumerate(inputs):
            p = self.registers.get(r)
            chained = p is None
            if p is None and r in self.views:
                p = self.views[r][0]
            if p is None:
                continue
            below = tuple(
                self.views[o][1] if o in self.views and self.views[o][0] is p else None for o in outputs
            )
            out.append(Read(i, p, chained, below))
        return out

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
    places, size = pack(lives)
    arena = np.empty(size + ALIGN, np.uint8)
    skip = -arena.ctypes.data % ALIGN  # each place 64-byte aligned in memory too
    whole = arena.data  # a memoryview of its bytes
    slab_of = {
        r: Slab(p.nbytes, np.frombuffer(whole[skip + p.start : skip + p.start + p.nbytes], np.uint8))
        for r, p in places.items()
    }
    for r, others in meeting(places).items():
        slab_of[r].meets = tuple(slab_of[q] for q in others)
    slabs = list(slab_of.values())
    regs = {r.id: r for r in device.registers}
    by_id = {t.id: t for t in device.tasks}
    out = {}
    views: dict[int, tuple[Planned, int]] = {}
    for life in lives:
        reg = regs[life.register]
        slab = slab_of[life.register]
        shape, dtype = value_shape(tensors[reg.tensor], by_id[reg.producer_task])
        out[reg.id] = Planned(slab, slab.view(shape, dtype), life.readers)
        for alias in life.aliases:  # read as the value itself once the step is bypassed
            out[alias] = out[reg.id]
        for view, below in life.views:
            views[view] = (out[reg.id], below)
    siblings = frozenset(id(slab.base) for slab in slabs)
    for slab in slabs:  # the owner's count with the plan's views alive, as free() reads it (an argument)
        slab.expected = sys.getrefcount(slab.base)
        slab.siblings = siblings
    return MemoryPlan(out, size, sum(life.nbytes for life in lives), views, siblings)


class Lender:
    """A producer's buffers: each planned output's view when its slab is free (else None: the kernel
    allocates), the other outputs' from :class:`~.tasks.OutputReuse` (its own previous value).

    ``take`` and ``keep`` run at every act of a planned producer (ResNet-18: ~400 a step); a producer of
    one planned output (most) takes a path of its own, with :meth:`Slab.free` written out."""

    __slots__ = ("lent", "nones", "one", "planned", "reuse")

    def __init__(self, planned: tuple[Planned | None, ...], reuse: OutputReuse | None) -> None:
        self.planned = planned
        # OutputReuse serves the outputs the plan leaves out; with none, it would lend and keep nothing
        self.reuse = reuse if None in planned else None
        self.lent: tuple[Any, ...] = ()
        self.nones = (None,) * len(planned)
        self.one = planned[0] if len(planned) == 1 else None

    def take(self) -> tuple[Any, ...]:
        p = self.one
        if p is not None:
            slab = p.slab
            if p.viewed or slab.pending or slab.retired:
                self.lent = self.nones
            elif sys.getrefcount(slab.base) <= slab.expected:  # Slab.free
                self.lent = (p.view,) if all(not s.occupied or s.dead() for s in slab.meets) else self.nones
            else:
                slab.free()  # a view nobody expected holds it: its register leaves the plan
                self.lent = self.nones
            return self.lent
        own = self.reuse.take() if self.reuse is not None else self.nones
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
        lent, self.lent = self.lent, ()
        i = 0
        for view in lent:
            p = self.planned[i]
            if view is not None and p is not None:  # a planned output's view (else OutputReuse's, or none)
                slab = p.slab
                slab.holder = p
                j = 0
                for r in results:
                    held = getattr(r, "base", None)
                    if r is view:  # into the lent view: the slab holds its value (as another output: retired)
                        slab.occupied = True
                        if i == j:
                            slab.pending = p.readers
                        else:
                            slab.retired = slab.occupied = True
                    elif held is slab.base:
                        adopt(p, r, i == j)
                    elif held is not None:
                        untracked(r, slab)
                    j += 1
            i += 1


def adopt(p: Planned, value: Any, own: bool) -> None:
    """``value``, an output its producer made as a view of ``p``'s lent bytes (attention's GEMMs write
    [B, H, T, D] laid out [B, T, H, D]), holds a live value on the slab: it is occupied, so that a slab
    whose bytes meet its own is not lent over it. As the register's own value (``own``: its output
    position, its shape and dtype), the plan lends that array from then on, and its readers' reads count;
    else the slab's refcount guards it until it dies (:meth:`Slab.dead`)."""
    slab = p.slab
    slab.occupied = True
    if own and value.shape == p.view.shape and value.dtype == p.view.dtype:
        p.view = value  # one reference for another: the owner's count with the plan's views alive holds
        slab.pending = p.readers


def untracked(value: Any, slab: Slab) -> None:
    """Retires ``slab`` if ``value`` is on its memory through something other than its owner: numba's
    view of an input (its base a numba MemInfo) or an array on a memoryview holds the slab's memory
    without the owner's count showing it. An array that owns its memory (base None) is on no slab."""
    held = getattr(value, "base", None)
    if (
        held is not None
        and held is not slab.base
        and id(held) not in slab.siblings
        and np.may_share_memory(value, slab.base)
    ):
        slab.retired = slab.occupied = True


class Read(NamedTuple):
    """A read :func:`watch` counts: the input ``position`` of a value of ``planned``'s register
    (``chained``: of a view of it), and per output of the reader the reads below it where it is a planned
    view of that value (a view op's; None for the others)."""

    position: int
    planned: Planned
    chained: bool = False
    below: tuple[int | None, ...] = ()


def watch(act: Act, reads: Sequence[Read | tuple[int, Planned]]) -> Act:
    """``act`` (a reader of planned registers or of views of them, at positions of its values), counting
    its reads of the values slabs hold: a read of the value itself (the plan's view of the slab), or of a
    view of it (an array whose base is the slab's owner); a planned view it makes that is not on the slab
    (a reshape that copied) takes the reads below it off the count. A slab whose value it returns as its
    own output is retired, a register whose value it returns a view of that the plan did not expect leaves
    the plan (:class:`Planned`)."""
    watched = tuple(Read(*r) for r in reads)

    def watching(step: int, values: list[Any]) -> list[Any]:
        outs = act(step, values)
        for position, p, chained, below in watched:
            value, slab, view = values[position], p.slab, p.view
            if chained:
                if value is view or getattr(value, "base", None) is not slab.base:
                    continue  # not on the slab (its producer allocated, a view op copied); the view: below
            elif value is not view:
                continue
            base, j = slab.base, 0
            for o in outs:
                if o is view:
                    slab.retired = slab.occupied = True
                else:
                    held = getattr(o, "base", None)
                    expected = below[j] if j < len(below) else None
                    if held is base:
                        if expected is None:
                            p.viewed = True
                    else:
                        if held is not None:
                            untracked(o, slab)
                        if expected:  # a view op's output not on the slab: its readers read no slab
                            slab.pending = max(0, slab.pending - expected)
                j += 1
            slab.pending = max(0, slab.pending - 1) if chained else slab.pending - 1
        return outs

    return watching
