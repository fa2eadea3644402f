"""The acts of boxing tasks: one step of a boxing on one rank, through the transport.

Lowering makes one task per plan step per rank (a group collective, or a local step), and between
placements a SEND on each source rank and a RECV on each destination rank per (source, destination)
pair, plus, on a destination that needs more than one received piece, a BOXING task that assembles its
shard (``local slice``) or writes zeros (``zero fill``). Each task carries its step as data
(``Task.boxing``: the step's position, its nd-SBPs, the mesh axis and the group's ranks, or the
transfers it takes part in and the regions of this rank's shards), so the act is made from the task
alone: the runtime never re-plans a boxing.

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
from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.actor_workers.execution.tasks import Act, RankContext, local_shape
from sbpflow.boxing import Transfer
from sbpflow.codec import wire
from sbpflow.errors import SbpflowError, ShapeError
from sbpflow.sbp import NdSbp, PartialSum, Split
from sbpflow.sharding import Index, split_range
from sbpflow.v1 import plan_pb2 as pp


class BoxingTaskError(SbpflowError, ValueError):
    """A boxing task whose step the runtime cannot run (missing or inconsistent step data)."""


@dataclass(frozen=True)
class Step:
    """A boxing task's step, decoded from ``Task.boxing`` once, when its act is made."""

    index: int
    collective: int  # a pp.CollectiveKind
    from_sbp: NdSbp
    to_sbp: NdSbp
    point_to_point: bool
    mesh_axis: int
    group: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    src_region: Index
    dst_region: Index
    peer: int


def region_of(m: pp.Region) -> Index:
    return tuple(slice(a, b) for a, b in zip(m.start, m.stop, strict=True))


def step_of(task: pp.Task, rank: int) -> Step:
    """The step ``task`` runs on ``rank``, from the plan; refused, naming the task, when the plan does not
    carry it (a plan from an older compiler) or it does not involve ``rank``."""
    b = task.boxing
    what = f"boxing task {task.id} of {task.op_name!r} ({b.from_sbp} -> {b.to_sbp}) on rank {rank}"
    if not b.from_nd_sbp.sbp or not b.to_nd_sbp.sbp:
        raise BoxingTaskError(f"{what} carries no step data (Task.boxing); recompile the job")
    step = Step(
        b.step,
        b.collective,
        wire.nd_sbp_from_proto(b.from_nd_sbp),
        wire.nd_sbp_from_proto(b.to_nd_sbp),
        b.point_to_point,
        b.mesh_axis,
        tuple(b.group),
        tuple(Transfer(t.src, t.dst, region_of(t.region)) for t in b.transfers),
        region_of(b.src_region),
        region_of(b.dst_region),
        b.peer,
    )
    if not step.point_to_point and rank not in step.group:
        raise BoxingTaskError(f"{what} runs a group step of group {list(step.group)}; recompile the job")
    if task.kind != pp.TASK_KIND_BOXING and not step.transfers:
        raise BoxingTaskError(f"{what} moves nothing to or from rank {step.peer}; recompile the job")
    return step


def moves_nothing(step: Step) -> bool:
    """A group step that is an identity, or on a group of one (one rank holds the whole)."""
    return not step.point_to_point and (step.from_sbp == step.to_sbp or len(step.group) == 1)


def tag_of(op_name: str, step: int, micro_batch: int) -> str:
    return f"{op_name}#{step}" if micro_batch < 0 else f"{op_name}#{step}@mb{micro_batch}"


def boxing_act(rc: RankContext, task: pp.Task, step: Step, dtype: np.dtype | None) -> Act:
    """The act of boxing task ``task`` running ``step``; ``dtype``: its output register's element type."""
    tag = tag_of(task.op_name, step.index, task.micro_batch)
    if task.kind == pp.TASK_KIND_SEND:
        return _send(rc, step, tag)
    assert dtype is not None
    if task.kind == pp.TASK_KIND_RECV:
        return _recv(rc, step, dtype, tag)
    if step.point_to_point:
        return _assemble(rc, step, dtype)
    return _group_step(rc, step, tag)


# ---- collectives on one placement ------------------------------------------------------------------


def _group_step(rc: RankContext, step: Step, tag: str) -> Act:
    if moves_nothing(step):  # a group of one holds the whole: nothing moves
        return lambda s, values: [values[0]]
    k, group = step.mesh_axis, step.group
    me = group.index(rc.rank)
    src, dst, first, xp = step.from_sbp[k], step.to_sbp[k], me == 0, rc.xp
    t = rc.transport
    keep = first or not isinstance(dst, PartialSum)
    ops: dict[int, Callable[[Any], Any]] = {
        pp.COLLECTIVE_KIND_ALL_REDUCE: lambda a: t.all_reduce(a, group, tag),
        pp.COLLECTIVE_KIND_REDUCE_SCATTER: lambda a: t.reduce_scatter(a, group, _axis(dst), tag),
        pp.COLLECTIVE_KIND_ALL_GATHER: lambda a: t.all_gather(a, group, _axis(src), tag),
        pp.COLLECTIVE_KIND_ALL_TO_ALL: lambda a: t.all_to_all(a, group, _axis(dst), _axis(src), tag),
        pp.COLLECTIVE_KIND_LOCAL_SLICE: lambda a: _part(a, _axis(dst), len(group), me),
        pp.COLLECTIVE_KIND_ZERO_FILL: lambda a: a,
    }
    run = ops[step.collective]
    local = (pp.COLLECTIVE_KIND_LOCAL_SLICE, pp.COLLECTIVE_KIND_ZERO_FILL)
    if step.collective not in local and t is None:
        raise BoxingTaskError(
            f"rank {rc.rank} runs step {step.index} of a boxing ({tag}) but has no transport"
        )

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


def _local(region: Index, origin: Index) -> Index:
    return tuple(slice(r.start - o.start, r.stop - o.start) for r, o in zip(region, origin, strict=True))


def _send(rc: RankContext, step: Step, tag: str) -> Act:
    """Cut the regions the peer takes from this rank's source shard; several go packed, flat, in order."""
    dst = step.peer
    regions = [_local(tr.region, step.src_region) for tr in step.transfers]
    t, xp = rc.transport, rc.xp

    def act(s: int, values: list[Any]) -> list[Any]:
        a = values[0]
        piece = a[regions[0]] if len(regions) == 1 else xp.concatenate([a[r].reshape(-1) for r in regions])
        t.send(piece, dst, tag)
        return []

    return act


def _recv(rc: RankContext, step: Step, dtype: np.dtype, tag: str) -> Act:
    trs, src = step.transfers, step.peer
    shape = local_shape(trs[0].region) if len(trs) == 1 else (sum(tr.numel for tr in trs),)
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


def _assemble(rc: RankContext, step: Step, dtype: np.dtype) -> Act:
    """This destination rank's shard from its inputs: its own source shard (when it holds one) and the
    pieces received, in the order lowering lists them (by source, first transfer first); zeros where no
    transfer lands (a ``P`` shard other than the first)."""
    d, want = rc.rank, step.dst_region
    sources = list(dict.fromkeys(tr.src for tr in step.transfers))
    # per input, the (region of the output, how to take it from that input) it fills
    takes: list[list[tuple[Index, Callable[[Any], Any]]]] = []
    for s in sources:
        trs = [tr for tr in step.transfers if tr.src == s]
        if s == d:  # its own copy: cut from its source shard
            takes.append([(_local(tr.region, want), _cut(_local(tr.region, step.src_region))) for tr in trs])
        elif len(trs) == 1:
            takes.append([(_local(trs[0].region, want), _whole)])
        else:  # packed: consecutive flat runs, in transfer order
            runs, at = [], 0
            for tr in trs:
                runs.append((_local(tr.region, want), _unpack(at, local_shape(tr.region))))
                at += tr.numel
            takes.append(runs)
    shape, xp = local_shape(want), rc.xp

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
