"""What each task of a plan does when its actor acts: the act functions of one rank.

An act is ``act(step, inputs) -> outputs``: ``step`` is the engine's iteration (the optimizer step),
``inputs`` the values of the task's input registers in order, and it returns one value per output
register. Everything a task needs (its op, attrs, mesh coordinate, shard indices, the rows it loads) is
read from the plan — the task and the plan's tables (:mod:`.plan_tables`) — once, when the act is made, so
an act does no protobuf parsing and little Python.

    task            act
    KERNEL          the op's kernel on this rank's shards (KernelContext: in/out index from the tensors'
    OPTIMIZER       placement and nd-SBP at this rank's mesh coordinate, seed, random step)
    DATA_LOAD       this rank's rows of micro-batch k of batch ``step`` from the data source
    ACCUMULATE      running sum over the micro-batches, divided by their number at the last
    SOURCE          the variable's value for this step (the store's at step 0, then last step's assign)
    SINK assign     writes the new value to the store and passes it on to next step's SOURCE (folded
                    into the act that makes the value where it only stores that: :func:`assigning`)
    SINK fetch      records the value of ``step`` (the loss, a fetch)

Random steps follow :func:`sbpflow.oracle.reference.micro_batch_step`: a task of micro-batch ``k`` of ``M`` in
step ``s`` draws with ``s * M + k``; once-per-step tasks (the update) with ``s``. Boxing, SEND and RECV
acts are in :mod:`.boxing_tasks`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from sbpflow.actor_workers.execution.plan_tables import PlanTables
from sbpflow.actor_workers.execution.variables import Store, is_partial_elsewhere
from sbpflow.actor_workers.runtime.cuda_streams import ComputeStream
from sbpflow.codec import wire
from sbpflow.errors import SbpflowError, ShapeError
from sbpflow.graph import TensorDecl
from sbpflow.ops.base import KernelContext, get_op
from sbpflow.oracle.reference import micro_batch_step
from sbpflow.sharding import Index, shard_index
from sbpflow.v1 import plan_pb2 as pp

Act = Callable[[int, list[Any]], list[Any]]


@dataclass
class RankContext:
    """What the acts of one rank share: the plan's tables, its store, what its sinks fetched."""

    rank: int
    tables: PlanTables  # the tensors (per micro-batch, with placements and SBPs), data, config, ...
    micro_batches: int
    store: Store
    transport: Any = None  # a Transport; None for a plan without communication
    xp: ModuleType = np
    compute: ComputeStream | None = (
        None  # a GPU worker's compute stream (sbpflow.actor_workers.runtime.cuda_streams)
    )
    plan_memory: bool = True  # registers share buffers by lifetime (.memory_plan; the executor builds it)
    busy: dict[str, float] = field(default_factory=dict)  # stream -> seconds in acts (the engine adds)
    # (tensor, micro-batch or -1) -> step -> this rank's value
    fetched: dict[tuple[str, int], dict[int, Any]] = field(default_factory=dict)
    # each called, in order, by every SINK fetch act with (tensor, micro-batch, step, value): progress
    fetch_hooks: list[Callable[[str, int, int, Any], None]] = field(default_factory=list)
    # each called, in order, by every SINK assign act with (variable, step) once the store holds the new
    # value: progress, checkpoint snapshots
    assign_hooks: list[Callable[[str, int], None]] = field(default_factory=list)
    _batches: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)

    def random_step(self, step: int, micro_batch: int) -> int:
        return step if micro_batch < 0 else micro_batch_step(step, micro_batch, self.micro_batches)

    def read_rows(self, step: int, start: int, stop: int) -> dict[str, Any]:
        """Rows ``[start, stop)`` of batch ``step``, every field; the loaders of one rank share a read."""
        key = (step, start, stop)
        batch = self._batches.get(key)
        if batch is None:
            assert self.tables.data is not None
            for old in [k for k in self._batches if k[0] < step - 1]:  # loaders run a step apart at most
                del self._batches[old]  # (one further behind reads its batch again: the same rows)
            batch = self._batches[key] = self.tables.data.read(step, slice(start, stop))
        return batch


def coord_index(decl: TensorDecl, mesh: tuple[int, ...], coord: tuple[int, ...]) -> Index:
    assert decl.sbp is not None
    return shard_index(decl.meta.shape, mesh, decl.sbp, coord)


def local_shape(index: Index) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


# ---- kernels -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DonatingKernelContext(KernelContext):
    """A kernel context that gives the kernel the arrays of its inputs at positions ``donated``: no other
    act reads them, so the kernel may write its results into them (:func:`sbpflow.ops.training.optim.donated`);
    and, per output, a retired array of the same shape it may write that output into
    (``out_buffers``, :func:`sbpflow.ops.training.optim.out_buffer`)."""

    donated: frozenset[int] = frozenset()
    out_buffers: tuple[Any, ...] = ()
    # each output's local shape and dtype (out_shape(i), out_dtype(i)), when the act made them once: a
    # kernel asks out_array for its buffer at every act (() : asked of the metas each time)
    out_kinds: tuple[tuple[Any, Any], ...] = ()

    def out_array(self, i: int = 0) -> Any:
        kinds = self.out_kinds
        if not kinds:
            return super().out_array(i)
        bufs = self.out_buffers
        b = bufs[i] if i < len(bufs) else None
        if b is None:
            return None
        shape, dtype = kinds[i]
        return b if b.shape == shape and b.dtype == dtype else None


@dataclass
class Recycler:
    """A variable's update writes each new value into the array of the value two steps back.

    At step ``s`` the update reads ``v_s`` and makes ``v_{s+1}``. Every reader of ``v_{s-1}`` has finished
    by then: the variable's SOURCE emitted ``v_s`` into a one-slot register (or, with the SOURCE bypassed,
    the SINK wrote it into the one-slot loop edge the readers read), which it could only do once every
    reader of ``v_{s-1}`` acked, and readers ack after their act. With the SINK folded into the update
    (:func:`~.executor_analysis.folded_assigns`) the update writes the edge, of two slots: its act at step
    ``s`` takes the slot ``v_s`` does not hold, so it acts once ``v_{s-1}`` is freed, every reader of it
    acked. So ``v_{s-1}``'s array is dead —
    unless a reader passed on a view of it (a reshape, a local slice): :func:`guard_aliases` watches the
    readers' outputs and turns recycling off for good when one shares memory with the value it read.
    Only arrays the update itself made are recycled (never the store's initial value, which a caller may
    own). Saves a fresh allocation, and its page faults, per parameter per step.

    An update whose op is ``in_place`` (its kernel may write the new value over the old:
    ``optim.in_place``) is lent ``v_s``'s own array once nothing else holds it: one array a parameter, as
    PyTorch's optimizers keep, not two. Every other reader of ``v_s`` holds it until its act is done (in
    its inbox, then in its act's values; a view keeps it through the view's base; a checkpoint copies it
    in the assign act), so CPython's refcount shows whether the update is its last reader: the act's
    values, this method's local and ``getrefcount``'s argument (:data:`ALONE`), and the rank's store
    where it holds the value. Only an array the update made (from the second step on), owning its
    memory; the older array is then not kept."""

    input: int  # the position of the variable among the update's inputs
    ok: bool = True
    prev: Any = None  # v_{s-1}, once the update has seen it
    started: bool = False
    in_place: bool = False  # the update's op may write its new value over the old (OpDef.in_place)
    store: Store | None = None  # the rank's variables, which hold the current value between steps
    name: str = ""  # the variable
    placed: int = 0  # the steps updated in place

    def take(self, arrays: list[Any]) -> Any:
        """The buffer the update may write into now; remembers this step's value for the next."""
        current = arrays[self.input]
        if self.in_place and self.ok and self.started and getattr(current, "base", True) is None:
            held = ALONE + (self.store is not None and self.store.holds(self.name, current))
            if sys.getrefcount(current) <= held:
                self.prev = None
                self.placed += 1
                return current
        buffer = self.prev if self.ok and self.prev is not current else None
        # the first value is the store's initial array (drawn, or given by a checkpoint): never recycled
        self.prev = current if self.started else None
        self.started = True
        return buffer


# References to a variable's value at its update's Recycler.take when nothing else holds it: the act's
# values, take's local and getrefcount's argument (the rank's store adds one where it holds the value;
# tests/actor_workers/execution/test_in_place_updates.py pins the count against the engine's references).
ALONE = 3

# References to a kernel's previous output when nobody else holds it: OutputReuse.prev, the local name in
# ``take`` and getrefcount's argument. Any holder beyond those (a consumer's inbox or the list of values
# its act reads, a view's base, the store, a fetch, a transfer in flight, an engine register kept for
# RunResult.last) adds one, and the array is not lent
# (tests/actor_workers/execution/test_output_reuse.py pins the count against the engine's references).
UNHELD = 3


class OutputReuse:
    """A kernel writes each output into its own previous value of that output once nobody holds it.

    Register reuse by lifetime: a one-slot register's value of step ``s`` is dead once every consumer has
    acked it, which is before the producer can act for step ``s + 1`` (the slot must be free). What the
    plan cannot see — a consumer that passed on a view of it, stored it, or still sends it — holds a
    reference, so CPython's refcount decides at each act (:data:`UNHELD`). Only arrays that own their
    memory and that the kernel made (not one of its inputs) are kept; kernels take them through
    ``KernelContext.out_array``. After warm-up such a kernel allocates nothing."""

    __slots__ = ("prev", "reuse")

    def __init__(self, reuse: Sequence[bool]) -> None:
        self.reuse = tuple(reuse)  # per output: its register has one slot
        self.prev: list[Any] = [None] * len(self.reuse)

    def take(self) -> tuple[Any, ...]:
        out = []
        for p in self.prev:
            out.append(p if p is not None and sys.getrefcount(p) <= UNHELD else None)
        return tuple(out)

    def keep(self, results: Sequence[Any], inputs: Sequence[Any]) -> None:
        prev, reuse = self.prev, self.reuse
        i = 0
        for r in results:
            if reuse[i] and type(r) is np.ndarray and r.base is None and r.ndim > 0 and r.flags.writeable:
                for x in inputs:
                    if r is x:  # an input passed on: not the kernel's to reuse
                        r = None
                        break
                prev[i] = r
            else:
                prev[i] = None
            i += 1


class Reuse(Protocol):
    """What lends a kernel its output buffers: :class:`OutputReuse`, or a memory plan's lender
    (:class:`~.memory_plan.Lender`): ``take`` before the act, ``keep`` what it returned."""

    def take(self) -> tuple[Any, ...]: ...

    def keep(self, results: Sequence[Any], inputs: Sequence[Any]) -> None: ...


def guard_aliases(
    act: Act, recycler: Recycler, position: int, xp: ModuleType, owners: Collection[int] = frozenset()
) -> Act:
    """``act`` (a reader of a recycled variable at input ``position``), turning recycling off if one of its
    outputs shares memory with the variable's value. ``owners``: id() of arrays that own memory of their
    own (a memory plan's slabs, :attr:`~.memory_plan.MemoryPlan.owners`): an output on one of them, like
    one that owns its memory, is on another allocation than a value that owns its own, and numpy is not
    asked (a call a reader of a parameter, every step)."""

    def guarded(step: int, values: list[Any]) -> list[Any]:
        outs = act(step, values)
        if recycler.ok:
            value = values[position]
            alone = getattr(value, "base", True) is None  # the value owns its memory
            for o in outs:
                if not hasattr(o, "shape"):
                    continue
                base = getattr(o, "base", True)
                if o is not value and alone and (base is None or id(base) in owners):
                    continue
                if o is value or xp.may_share_memory(o, value):
                    recycler.ok = False
                    break
        return outs

    return guarded


def kernel_act(
    rc: RankContext,
    task: pp.Task,
    tensors: tuple[Sequence[str], Sequence[str]],
    donated: frozenset[int] = frozenset(),
    recycle: Recycler | None = None,
    reuse: Reuse | None = None,
) -> Act:
    """The kernel of ``task`` on this rank's shards of the tensors ``tensors`` (its inputs' and outputs'
    names, those its registers hold), at the task's mesh coordinate; its outputs are checked against the
    plan's shapes. ``donated``: positions of inputs no other act reads (see :func:`donations`);
    ``recycle``: the update of a variable whose first output may go into a retired array (:class:`Recycler`);
    ``reuse``: outputs written into their own dead previous values (:class:`OutputReuse`), or into buffers
    a memory plan shares (:class:`~.memory_plan.Lender`)."""
    decls = rc.tables.tensors
    op = get_op(task.op_type)
    attrs = op.normalize_attrs({k: wire.attr_from_proto(v) for k, v in task.attrs.items()})
    ins, outs = [decls[i] for i in tensors[0]], [decls[o] for o in tensors[1]]
    where = (outs or ins)[0].placement  # an op writes on its placement (lowering checks)
    assert where is not None
    coord = tuple(task.coord)
    in_index = tuple(coord_index(d, where.shape, coord) for d in ins)
    out_index = tuple(coord_index(d, where.shape, coord) for d in outs)
    expected = [(local_shape(ix), d.meta.dtype.to_numpy()) for ix, d in zip(out_index, outs, strict=True)]
    base = (rc.xp, attrs, tuple(d.meta for d in ins), tuple(d.meta for d in outs), in_index, out_index)
    seed, kernel, micro_batch = rc.tables.config.seed, op.run_kernel, task.micro_batch
    make: Callable[..., KernelContext] = KernelContext
    if donated or recycle is not None or reuse is not None:
        make = functools.partial(DonatingKernelContext, donated=donated)
    checked = False
    # One context a task, its step (and lent buffers) set per act through its __dict__: an actor acts one
    # step at a time, and a frozen dataclass built afresh was ~0.75 us of every act. Kernels still cannot
    # assign to it. The step is the random step: rc.random_step, as ``step * scale + offset``.
    ctx = make(*base, seed, 0)
    if make is not KernelContext:
        kinds = tuple((ctx.out_shape(i), ctx.out_dtype(i)) for i in range(len(outs)))
        ctx = make(*base, seed, 0, out_kinds=kinds)
    d = ctx.__dict__
    scale, offset = (rc.micro_batches, micro_batch) if micro_batch >= 0 else (1, 0)
    lending = recycle is not None or reuse is not None

    def act(step: int, arrays: list[Any]) -> list[Any]:
        nonlocal checked
        d["step"] = step * scale + offset
        if lending:
            d["out_buffers"] = (recycle.take(arrays),) if recycle is not None else reuse.take()  # type: ignore[union-attr]
            try:
                results = kernel(ctx, arrays)
            finally:
                d["out_buffers"] = ()  # holds no buffer between acts (OutputReuse counts holders)
            if reuse is not None:
                reuse.keep(results, arrays)
        else:
            results = kernel(ctx, arrays)
        if not checked:  # a kernel's output shapes depend on its input shapes only, fixed by the plan
            _check_outputs(task, rc.rank, tensors[1], results, expected)
            checked = True
        return list(results)

    return act


def _check_outputs(
    task: pp.Task, rank: int, names: Sequence[str], results: Sequence[Any], expected: list[tuple[Any, Any]]
) -> None:
    if len(results) != len(expected) or any(
        tuple(r.shape) != s or r.dtype != t for r, (s, t) in zip(results, expected, strict=False)
    ):
        got = [f"{list(r.shape)} {r.dtype}" for r in results]
        want = [f"{list(s)} {t}" for s, t in expected]
        raise ShapeError(
            f"op {task.op_name!r} ({task.op_type}) on rank {rank} produced {got}, but the plan expects "
            f"{want} (its outputs {list(names)} under their SBPs); the op's kernel and its SBP rows disagree"
        )


# ---- data ------------------------------------------------------------------------------------------------


def data_load_act(rc: RankContext, decl: TensorDecl, micro_batch: int, coord: tuple[int, ...]) -> Act:
    """This rank's share of input ``decl`` (at mesh coordinate ``coord``) for micro-batch ``micro_batch``
    of each step's batch.

    The plan's tensors are the micro-batch graph's, so ``decl.meta.shape[0]`` is the micro-batch's rows;
    micro-batch ``k`` is rows ``[k*m, (k+1)*m)`` of the batch (:func:`sbpflow.oracle.reference._split_batch`).
    """
    if rc.tables.data is None:
        raise SbpflowError(f"job {rc.tables.name!r} has no data source to load input {decl.name!r} from")
    assert decl.placement is not None
    index = coord_index(decl, decl.placement.shape, coord)
    dtype = decl.meta.dtype.to_numpy()
    zeros = is_partial_elsewhere(decl, coord)
    if not decl.meta.ndim:
        raise SbpflowError(f"input {decl.name!r} is a scalar; a data source feeds batches (axis 0 = samples)")
    first = max(micro_batch, 0) * decl.meta.shape[0]
    rows, rest = index[0], (slice(None), *index[1:])

    def act(step: int, _: list[Any]) -> list[Any]:
        batch = rc.read_rows(step, first + rows.start, first + rows.stop)
        value = batch[decl.name][rest]
        if value.dtype != dtype or tuple(value.shape) != local_shape(index):
            raise ShapeError(
                f"input {decl.name!r} is declared {decl.meta}, but the data source gives rank {rc.rank} "
                f"{list(value.shape)} {value.dtype} where it expects {list(local_shape(index))} {dtype}; "
                "make the source's field match the input"
            )
        return [rc.xp.zeros_like(value) if zeros else rc.xp.asarray(value)]

    return act


def accumulate_act(rc: RankContext, first: bool, divide_by: int) -> Act:
    """``((g0 + g1) + g2) + g3`` in the reference's order, then ``/ M`` at the last micro-batch."""

    def act(step: int, values: list[Any]) -> list[Any]:
        acc = values[0] if first else values[0] + values[1]
        if divide_by > 1:
            acc = acc / rc.xp.asarray(divide_by, dtype=acc.dtype)
        return [acc]

    return act


# ---- variables and fetches ----------------------------------------------------------------------------


def source_act(rc: RankContext, name: str, looped: bool) -> Act:
    """A looped source passes on the value its loop edge carries (the engine's ``initial`` at step 0,
    then the previous step's assign); an unlooped one (never assigned) re-reads the store."""
    if looped:
        return lambda step, values: [values[0]]
    return lambda step, values: [rc.store[name]]


def assign_act(rc: RankContext, name: str, looped: bool) -> Act:
    def act(step: int, values: list[Any]) -> list[Any]:
        rc.store[name] = values[0]
        for hook in rc.assign_hooks:
            hook(name, step)
        return [values[0]] if looped else []

    return act


def assigning(act: Act, rc: RankContext, assigns: Sequence[tuple[int, str]]) -> Act:
    """``act`` (a kernel or an update) doing the work of the SINK assigns folded into it
    (:func:`~.executor_analysis.folded_assigns`): each (output position, variable) of ``assigns`` is
    stored, and the assign hooks called, as :func:`assign_act` does, once the act has made the values."""
    pairs = tuple(assigns)

    def act_and_assign(step: int, values: list[Any]) -> list[Any]:
        outs = act(step, values)
        for j, name in pairs:
            rc.store[name] = outs[j]
            for hook in rc.assign_hooks:
                hook(name, step)
        return outs

    return act_and_assign


def fetch_act(rc: RankContext, name: str, micro_batch: int) -> Act:
    record = rc.fetched.setdefault((name, micro_batch), {})

    def act(step: int, values: list[Any]) -> list[Any]:
        record[step] = values[0]
        for hook in rc.fetch_hooks:
            hook(name, micro_batch, step, values[0])
        return []

    return act


def spread(act: Act, positions: Sequence[int], n_values: int) -> Act:
    """``act`` reading its inputs at ``positions`` of the engine's deduplicated list of ``n_values``
    input values (``x * x`` reads one register twice; an actor lists it once)."""
    if list(positions) == list(range(n_values)):
        return act
    pos = tuple(positions)
    return lambda step, values: act(step, [values[p] for p in pos])
