"""Boxing: the communication that turns a tensor's producer layout into its consumer's.

The planner is separate from the executor: :func:`plan_boxing` returns a :class:`BoxingPlan`, a
printable, hashable value (``P -> S(0): reduce-scatter, 96 B``) that is cached, recorded in the plan with
its byte count, and executed step by step by the runtime.

Same placement, one mesh axis of ``p`` ranks, ``|T|`` the bytes the group holds (OneFlow's cost model):

    from -> to     collective       bytes moved (all ranks together)
    P -> B         all-reduce       2(p-1)|T|
    P -> S(i)      reduce-scatter   (p-1)|T|
    S(i) -> B      all-gather       (p-1)|T|
    S(i) -> S(j)   all-to-all       (p-1)/p |T|   (exactly: what leaves each rank, uneven splits included)
    B -> S(i)      local slice      0
    B -> P         zero fill        0  (rank 0 keeps the value, the others hold zeros)

An nd-SBP changes one mesh axis at a time, each axis a set of independent groups. When two mesh axes
split the same tensor axis (a hierarchical split) a per-axis step would not be a group collective, so
the plan gathers inner axes first, then slices. Between different placements the tensor is first made
whole on the source side where it is partial, then each destination rank receives the overlap of its
shard with the source shards, point to point.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from itertools import product
from math import prod

from sbpflow.placement import Placement
from sbpflow.sbp import B, NdSbp, PartialSum, Sbp, Split, format_nd
from sbpflow.sharding import Index, divides, shard_index, split_range
from sbpflow.tensor_meta import TensorMeta


class Collective(StrEnum):
    all_reduce = "all-reduce"
    reduce_scatter = "reduce-scatter"
    all_gather = "all-gather"
    all_to_all = "all-to-all"
    local_slice = "local slice"
    zero_fill = "zero fill"
    p2p = "point-to-point"


@dataclass(frozen=True)
class Transfer:
    """One point-to-point copy of ``region`` (slices of the logical tensor) from ``src`` to ``dst``."""

    src: int
    dst: int
    region: Index

    @property
    def numel(self) -> int:
        return prod(s.stop - s.start for s in self.region)


@dataclass(frozen=True)
class BoxingStep:
    collective: Collective
    mesh_axis: int | None  # the mesh axis whose groups run the collective; None for point-to-point
    from_sbp: NdSbp
    to_sbp: NdSbp
    bytes: int
    transfers: tuple[Transfer, ...] = ()

    def __repr__(self) -> str:
        where = "" if self.mesh_axis is None else f" on mesh axis {self.mesh_axis}"
        return f"{format_nd(self.from_sbp)} -> {format_nd(self.to_sbp)}: {self.collective.value}{where}, {self.bytes} B"


@dataclass(frozen=True)
class BoxingPlan:
    meta: TensorMeta
    src: Placement
    src_sbp: NdSbp
    dst: Placement
    dst_sbp: NdSbp
    steps: tuple[BoxingStep, ...]

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.steps)

    @property
    def is_identity(self) -> bool:
        return not self.steps

    def __repr__(self) -> str:
        head = f"{format_nd(self.src_sbp)} -> {format_nd(self.dst_sbp)}"
        if self.src != self.dst:
            head += f" ({self.src.size} -> {self.dst.size} ranks)"
        if len(self.steps) == 1 and self.src == self.dst:
            return repr(self.steps[0])
        return head + ": " + ("nothing" if not self.steps else "; ".join(map(repr, self.steps)))


# ---- the 1-d cost table ---------------------------------------------------------------------------


def _kind(s: Sbp) -> str:
    return "S" if isinstance(s, Split) else repr(s)


ONE_D: dict[tuple[str, str], Collective] = {
    ("P", "B"): Collective.all_reduce,
    ("P", "S"): Collective.reduce_scatter,
    ("S", "B"): Collective.all_gather,
    ("S", "S"): Collective.all_to_all,
    ("B", "S"): Collective.local_slice,
    ("B", "P"): Collective.zero_fill,
}


def _group_bytes(
    collective: Collective, src: Sbp, dst: Sbp, region: tuple[int, ...], p: int, itemsize: int
) -> int:
    """Bytes one group of ``p`` ranks moves to box ``region`` from ``src`` to ``dst``."""
    t = prod(region) * itemsize
    if collective is Collective.all_reduce:
        return 2 * (p - 1) * t
    if collective in (Collective.reduce_scatter, Collective.all_gather):
        return (p - 1) * t
    if collective is Collective.all_to_all:
        assert isinstance(src, Split) and isinstance(dst, Split)
        ni, nj = region[src.axis], region[dst.axis]
        rest = prod(region) // (ni * nj) if ni * nj else 0
        kept = sum(_len(ni, p, r) * _len(nj, p, r) for r in range(p))  # what each rank already holds
        return (ni * nj - kept) * rest * itemsize
    return 0


def _len(n: int, p: int, r: int) -> int:
    a, b = split_range(n, p, r)
    return b - a


# ---- planning -------------------------------------------------------------------------------------


@lru_cache(maxsize=1 << 14)
def plan_boxing(
    meta: TensorMeta, src: Placement, src_sbp: NdSbp, dst: Placement, dst_sbp: NdSbp
) -> BoxingPlan:
    """The steps that turn (src, src_sbp) into (dst, dst_sbp) for a tensor of ``meta``."""
    if src == dst:
        steps = _same_placement(meta, src, src_sbp, dst_sbp)
    else:
        steps = _across_placements(meta, src, src_sbp, dst, dst_sbp)
    return BoxingPlan(meta, src, src_sbp, dst, dst_sbp, tuple(steps))


@lru_cache(maxsize=1 << 16)
def boxing_cost(
    meta: TensorMeta, src: Placement, src_sbp: NdSbp, dst: Placement, dst_sbp: NdSbp
) -> tuple[int, int]:
    """``(plan.bytes, len(plan.steps))`` of ``plan_boxing`` without building the point-to-point transfers:
    SBP inference prices thousands of candidate layouts between pipeline stages, and a plan between two
    64-rank meshes intersects every pair of shards. Each destination rank receives its shard less the part
    it already holds itself (``_cover`` takes a rank's own copy first), so the bytes are a sum over ranks."""
    if src != dst:
        pre: list[BoxingStep] = []
        cur = src_sbp
        if any(isinstance(s, PartialSum) for s in src_sbp):
            cur = tuple(B if isinstance(s, PartialSum) else s for s in src_sbp)
            pre = _same_placement(meta, src, src_sbp, cur)
        if set(src.ranks).isdisjoint(dst.ranks):  # stage to stage: every shard is sent whole
            # the shards over split axes partition the tensor, B axes repeat it, P axes send one copy
            copies = prod(n for n, s in zip(dst.shape, dst_sbp, strict=True) if s == B)
            return sum(s.bytes for s in pre) + meta.numel * copies * meta.dtype.itemsize, len(pre) + 1
        own = {src.rank_at(c): shard_index(meta.shape, src.shape, cur, c) for c in src.coords()}
        moved = 0
        for c in dst.coords():
            if any(isinstance(s, PartialSum) and c[i] != 0 for i, s in enumerate(dst_sbp)):
                continue
            want = shard_index(meta.shape, dst.shape, dst_sbp, c)
            have = own.get(dst.rank_at(c))
            kept = _intersect(want, have) if have is not None else None
            moved += _numel(want) - (_numel(kept) if kept is not None else 0)
        return sum(s.bytes for s in pre) + moved * meta.dtype.itemsize, len(pre) + 1
    plan = plan_boxing(meta, src, src_sbp, dst, dst_sbp)
    return plan.bytes, len(plan.steps)


def _numel(index: Index) -> int:
    return prod(max(0, s.stop - s.start) for s in index)


def _hierarchical(nd: NdSbp) -> bool:
    axes = [s.axis for s in nd if isinstance(s, Split)]
    return len(axes) != len(set(axes))


def _same_placement(meta: TensorMeta, pl: Placement, src: NdSbp, dst: NdSbp) -> list[BoxingStep]:
    if src == dst:
        return []
    direct = [k for k in range(pl.ndim) if src[k] != dst[k]]
    path = [(k, dst[k]) for k in direct]
    if _hierarchical(src) or _hierarchical(dst) or any(_hierarchical(n) for n in _intermediates(src, path)):
        # gather the innermost splits first, reduce partials, then slice: every step a group collective
        path = [(k, B) for k in reversed(range(pl.ndim)) if src[k] != B]
        path += [(k, dst[k]) for k in range(pl.ndim) if dst[k] != B]
    steps, cur = [], src
    for k, to in path:
        if cur[k] == to:
            continue
        steps.append(_axis_step(meta, pl, cur, k, to))
        cur = steps[-1].to_sbp
    return steps


def _intermediates(src: NdSbp, path: list[tuple[int, Sbp]]) -> list[NdSbp]:
    out, cur = [], list(src)
    for k, to in path:
        cur[k] = to
        out.append(tuple(cur))
    return out


def _axis_step(meta: TensorMeta, pl: Placement, cur: NdSbp, k: int, to: Sbp) -> BoxingStep:
    src = cur[k]
    new = tuple(to if i == k else s for i, s in enumerate(cur))
    key = (_kind(src), _kind(to))
    if key == ("S", "P"):
        # no single collective: gather, then keep rank 0's copy (zero fill is free)
        collective = Collective.all_gather
    else:
        collective = ONE_D[key]
    p = pl.shape[k]
    total = 0
    # one group per setting of the other mesh axes; the group holds the region its first member spans
    group_sbp = tuple(B if i == k else s for i, s in enumerate(cur))
    coords: Iterable[tuple[int, ...]] = product(
        *(range(d) if i != k else range(1) for i, d in enumerate(pl.shape))
    )
    groups = 1
    if divides(meta.shape, pl.shape, group_sbp):  # every group holds an equal region: price one
        coords, groups = [(0,) * pl.ndim], pl.size // p
    for coord in coords:
        index = shard_index(meta.shape, pl.shape, group_sbp, coord)
        region = tuple(s.stop - s.start for s in index)
        total += _group_bytes(collective, src, to, region, p, meta.dtype.itemsize)
    return BoxingStep(collective, k, cur, new, total * groups)


def _across_placements(
    meta: TensorMeta, src: Placement, src_sbp: NdSbp, dst: Placement, dst_sbp: NdSbp
) -> list[BoxingStep]:
    steps: list[BoxingStep] = []
    cur = src_sbp
    if any(isinstance(s, PartialSum) for s in src_sbp):
        whole = tuple(B if isinstance(s, PartialSum) else s for s in src_sbp)
        steps += _same_placement(meta, src, src_sbp, whole)
        cur = whole
    # each destination rank takes its shard from source shards, preferring a copy it already holds
    holders = [(src.rank_at(c), shard_index(meta.shape, src.shape, cur, c)) for c in src.coords()]
    own = dict(holders)
    # a later holder of a region an earlier one holds would serve nothing: keep the first (64 x 64 shards
    # between two pipeline stages would otherwise intersect every pair)
    first: dict[tuple[tuple[int, int], ...], tuple[int, Index]] = {}
    for rank, region in holders:
        first.setdefault(tuple((x.start, x.stop) for x in region), (rank, region))
    distinct = list(first.values())
    transfers: list[Transfer] = []
    for c in dst.coords():
        if any(isinstance(s, PartialSum) and c[i] != 0 for i, s in enumerate(dst_sbp)):
            continue  # partial ranks other than the first hold zeros
        d = dst.rank_at(c)
        want = shard_index(meta.shape, dst.shape, dst_sbp, c)
        mine = [(d, own[d])] if d in own else []
        transfers += _cover(d, want, mine + distinct)
    moved = sum(t.numel for t in transfers if t.src != t.dst) * meta.dtype.itemsize
    steps.append(BoxingStep(Collective.p2p, None, cur, dst_sbp, moved, tuple(transfers)))
    return steps


def _cover(dst: int, want: Index, holders: list[tuple[int, Index]]) -> list[Transfer]:
    """Transfers that fill ``want`` on ``dst``: its own copy first, then the first holder of each piece."""
    ordered = sorted(holders, key=lambda h: h[0] != dst)
    pieces: list[Index] = (
        [want] if all(s.start < s.stop for s in want) else []
    )  # an empty shard takes nothing
    out = []
    for rank, have in ordered:
        remaining = []
        for piece in pieces:
            inter = _intersect(piece, have)
            if inter is None:
                remaining.append(piece)
                continue
            out.append(Transfer(rank, dst, inter))
            remaining += _subtract(piece, inter)
        pieces = remaining
        if not pieces:
            break
    assert not pieces, "source shards must cover the tensor"
    return out


def _intersect(a: Index, b: Index) -> Index | None:
    out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b, strict=True))
    return out if all(s.start < s.stop for s in out) else None


def _subtract(box: Index, hole: Index) -> list[Index]:
    """``box`` minus ``hole`` (inside it) as disjoint boxes, peeling one axis at a time."""
    out = []
    cur = list(box)
    for i, (b, h) in enumerate(zip(box, hole, strict=True)):
        if b.start < h.start:
            out.append(tuple(cur[:i] + [slice(b.start, h.start)] + cur[i + 1 :]))
        if h.stop < b.stop:
            out.append(tuple(cur[:i] + [slice(h.stop, b.stop)] + cur[i + 1 :]))
        cur[i] = h
    return out
