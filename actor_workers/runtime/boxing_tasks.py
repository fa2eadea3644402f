"""The acts of boxing tasks: one step of a :class:`BoxingPlan` on one rank, through the transport.

Lowering makes one task per plan step per rank (a group collective, or a local step), and between
placements a SEND on each source rank and a RECV on each destination rank per (source, destination)
pair, plus, on a destination that needs more than one received piece, a BOXING task that assembles its
shard (``local slice``) or writes zeros (``zero fill``). The plan's task says which boxing node and which
step (its ``from``/``to`` SBPs); the regions come from re-planning that node with :func:`plan_boxing`,
a pure function of the compiled graph, as lowering itself does.

    step on mesh axis k      this rank (group = the ranks along k through this rank, in mesh order)
    P -> B                   all_reduce
    P -> S(i)                reduce_scatter along i
    S(i) -> B                all_gather along i
    S(i) -> P                all_gather along i, then zeros unless first along k
    S(i) -> S(j)             all_to_all: split along j, concatenate along i
    B -> S(i)                its part along i (split_range of the local extent)
    B -> P                   the value if first along k, else zeros
    X -> X                   the value (an identity boxing still gives the consumer its register)
    any, a group of one      the value (one rank holds the whole: B, S and P are the same there)

Every rank names a collective with the same tag (boxing node, step, micro-batch), so a mismatch is
reported by the transport with both names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sbpflow.actor_workers.runtime.tasks import Act, RankContext, local_shape
from sbpflow.boxing import BoxingPlan, BoxingStep, Collective, Transfer
from sbpflow.errors import SbpflowError, ShapeError
from sbpflow.sbp import PartialSum, Split, format_nd
from sbpflow.sharding import Index, shard_index, split_range
from sbpflow.v1 import plan_pb2 as pp


class BoxingTaskError(SbpflowError, ValueError):
    """A boxing task the runtime cannot match to a step of its boxing node's plan."""


def find_step(plan: BoxingPlan, op_name: str, from_sbp: str, to_sbp: str) -> tuple[int, BoxingStep]:
    """The step of ``plan`` that a task converting ``from_sbp -> to_sbp`` runs (steps never repeat an
    SBP: each moves one mesh axis towards the destination)."""
    if plan.is_identity and from_sbp == to_sbp:
        return 0, BoxingStep(Collective.local_slice, 0, plan.src_sbp, plan.dst_sbp, 0)
    for i, s in enumerate(plan.steps):
        if (format_nd(s.from_sbp), format_nd(s.to_sbp)) == (from_sbp, to_sbp):
            return i, s
    raise BoxingTaskError(
        f"boxing task of {op_name!r} converts {from_sbp} -> {to_sbp}, which no step of its plan {plan!r} does; "
        "the plan and the compiled graph disagree (recompile the job)"
    )


def tag_of(op_name: str, step: int, micro_batch: int) -> str:
    return f"{op_name}#{step}" if micro_batch < 0 else f"{op_name}#{step}@mb{micro_batch}"


def boxing_act(
    rc: RankContext, task: pp.Task, plan: BoxingPlan, step_no: int, step: BoxingStep, peer: int | None
) -> Act:
    tag = tag_of(task.op_name, step_no, task.micro_batch)
    if task.kind == pp.TASK_KIND_SEND:
        assert peer is not None
        return _send(rc, plan, step, peer, tag)
    if task.kind == pp.TASK_KIND_RECV:
        assert peer is not None
        return _recv(rc, plan, step, peer, tag)
    if step.collective is Collective.p2p:
        return _assemble(rc, plan, step)
    return _group_step(rc, plan, step, tag)


# ---- collectives on one placement ------------------------------------------------------------------


def _group_step(rc: RankContext, plan: BoxingPlan, step: BoxingStep, tag: str) -> Act:
    pl, k = plan.src, step.mesh_axis
    assert k is not None
    if step.from_sbp == step.to_sbp or pl.shape[k] == 1:  # a group of one holds the whole: nothing moves
        return lambda s, values: [values[0]]
    coord = pl.coord_of(rc.rank)
    group = tuple(pl.rank_at((*coord[:k], j, *coord[k + 1 :])) for j in range(pl.shape[k]))
    src, dst, first, xp = step.from_sbp[k], step.to_sbp[k], coord[k] == 0, rc.xp
    t = rc.transport
    keep = first or not isinstance(dst, PartialSum)
    ops: dict[Collective, Callable[[Any], Any]] = {
        Collective.all_reduce: lambda a: t.all_reduce(a, group, tag),
        Collective.reduce_scatter: lambda a: t.reduce_scatter(a, group, _axis(dst), tag),
        Collective.all_gather: lambda a: t.all_gather(a, group, _axis(src), tag),
        Collective.all_to_all: lambda a: t.all_to_all(a, group, _axis(dst), _axis(src), tag),
        Collective.local_slice: lambda a: _part(a, _axis(dst), len(group), coord[k]),
        Collective.zero_fill: lambda a: a,
    }
    run = ops[step.collective]
    if step.collective not in (Collective.local_slice, Collective.zero_fill) and t is None:
        raise BoxingTaskError(f"rank {rc.rank} runs {step!r} of a boxing but has no transport")

    def act(s: int, values: list[Any]) -> list[Any]:
        out = run(values[0])
        return [out if keep else xp.zeros_like(out)]

    return act


def _axis(s: object) -> int:
    assert isinstance(s, Split)
    return s.axis


def _part(a: Any, axis: int, parts: int, i: int) -> Any:
    lo, hi = split_range(a.shape[axis], parts, i)
    return a[(slice(None),) * axis + (slice(lo, hi),)]


# ---- point to point between placements --------------------------------------------------------------


def _src_index(plan: BoxingPlan, step: BoxingStep, rank: int) -> Index:
    return shard_index(plan.meta.shape, plan.src.shape, step.from_sbp, plan.src.coord_of(rank))


def _local(region: Index, origin: Index) -> Index:
    return tuple(slice(r.start - o.start, r.stop - o.start) for r, o in zip(region, origin, strict=True))


def _transfers(step: BoxingStep, s: int, d: int) -> list[Transfer]:
    return [tr for tr in step.transfers if tr.src == s and tr.dst == d]


def _send(rc: RankContext, plan: BoxingPlan, step: BoxingStep, dst: int, tag: str) -> Act:
    """Cut the regions ``dst`` takes from this rank's source shard; several go packed, flat, in order."""
    origin = _src_index(plan, step, rc.rank)
    regions = [_local(tr.region, origin) for tr in _transfers(step, rc.rank, dst)]
    if not regions:
        raise BoxingTaskError(f"rank {rc.rank} sends nothing to rank {dst} in {step!r}; the plan is stale")
    t, xp = rc.transport, rc.xp

    def act(s: int, values: list[Any]) -> list[Any]:
        a = values[0]
        piece = a[regions[0]] if len(regions) == 1 else xp.concatenate([a[r].reshape(-1) for r in regions])
        t.send(piece, dst, tag)
        return []

    return act


def _recv(rc: RankContext, plan: BoxingPlan, step: BoxingStep, src: int, tag: str) -> Act:
    trs = _transfers(step, src, rc.rank)
    shape = local_shape(trs[0].region) if len(trs) == 1 else (sum(tr.numel for tr in trs),)
    dtype = np.dtype(plan.meta.dtype.value)
    t = rc.transport

    def act(s: int, values: list[Any]) -> list[Any]:
        piece = t.recv(src, tag)
        if tuple(piece.shape) != shape or piece.dtype != dtype:
            raise ShapeError(
                f"rank {rc.rank} received {list(piece.shape)} {piece.dtype} from rank {src} under {tag!r}, "
                f"expected {list(shape)} {dtype}"
            )
        return [piece]

    return act


def _assemble(rc: RankContext, plan: BoxingPlan, step: BoxingStep) -> Act:
    """This destination rank's shard from its inputs: its own source shard (when it holds one) and the
    pieces received, in the order lowering lists them (by source, first transfer first); zeros where no
    transfer lands (a ``P`` shard other than the first)."""
    d, meta = rc.rank, plan.meta
    want = shard_index(meta.shape, plan.dst.shape, step.to_sbp, plan.dst.coord_of(d))
    sources = list(dict.fromkeys(tr.src for tr in step.transfers if tr.dst == d))
    # per input, the (region of the output, how to take it from that input) it fills
    takes: list[list[tuple[Index, Callable[[Any], Any]]]] = []
    for s in sources:
        trs = _transfers(step, s, d)
        if s == d:  # its own copy: cut from its source shard
            origin = _src_index(plan, step, d)
            takes.append([(_local(tr.region, want), _cut(_local(tr.region, origin))) for tr in trs])
        elif len(trs) == 1:
            takes.append([(_local(trs[0].region, want), _whole)])
        else:  # packed: consecutive flat runs, in transfer order
            runs, at = [], 0
            for tr in trs:
                runs.append((_local(tr.region, want), _unpack(at, local_shape(tr.region))))
                at += tr.numel
            takes.append(runs)
    shape, dtype, xp = local_shape(want), np.dtype(meta.dtype.value), rc.xp

    def act(s: int, values: list[Any]) -> list[Any]:
        out = xp.zeros(shape, dtype=dtype)
        for value, runs in zip(values, takes, strict=True):
            for region, take in runs:
                out[region] = take(value)
        return [out]

    return act


def _whole(a: Any) -> Any:
    return a


def _cut(index: Index) -> Callable[[Any], Any]:
    return lambda a: a[index]


def _unpack(at: int, shape: tuple[int, ...]) -> Callable[[Any], Any]:
    n = int(np.prod(shape))
    return lambda a: a[at : at + n].reshape(shape)
