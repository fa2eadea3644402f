"""Where each rank's shard of a global tensor lies, and how to cut a logical array into shards and back.

Splits are balanced and may be uneven: a dim of 10 over 4 ranks gives 3, 3, 2, 2 (the first ``n % p``
ranks take one more). An nd-SBP splits hierarchically: mesh axis 0 first, then mesh axis 1 splits each
part again, so ``(S(0), S(0))`` on a 2x2 mesh cuts dim 0 in four in row-major mesh order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from sbpflow.device import asnumpy
from sbpflow.errors import SbpError
from sbpflow.placement import Placement
from sbpflow.sbp import Broadcast, NdSbp, PartialSum, Split, format_nd
from sbpflow.tensor_meta import Shape, TensorMeta

Index = tuple[slice, ...]


def split_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """[start, stop) of part ``i`` when ``n`` items are cut into ``parts`` balanced parts."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def shard_index(shape: Shape, mesh: Sequence[int], nd_sbp: NdSbp, coord: Sequence[int]) -> Index:
    """The slices of the logical tensor that the rank at mesh ``coord`` holds."""
    bounds = [(0, d) for d in shape]
    for sbp, parts, c in zip(nd_sbp, mesh, coord, strict=True):
        if isinstance(sbp, Split):
            lo, hi = bounds[sbp.axis]
            a, b = split_range(hi - lo, parts, c)
            bounds[sbp.axis] = (lo + a, lo + b)
    return tuple(slice(lo, hi) for lo, hi in bounds)


def local_shape(shape: Shape, mesh: Sequence[int], nd_sbp: NdSbp, coord: Sequence[int]) -> Shape:
    return tuple(s.stop - s.start for s in shard_index(shape, mesh, nd_sbp, coord))


def min_split_size(shape: Shape, mesh: Sequence[int], nd_sbp: NdSbp) -> int:
    """The smallest extent any rank holds along a split axis (0 means some rank holds nothing)."""
    sizes = list(shape)
    smallest: int | None = None
    for sbp, parts in zip(nd_sbp, mesh, strict=True):
        if isinstance(sbp, Split):
            sizes[sbp.axis] = sizes[sbp.axis] // parts
            smallest = sizes[sbp.axis] if smallest is None else min(smallest, sizes[sbp.axis])
    return min(shape, default=1) if smallest is None else smallest


def divides(shape: Shape, mesh: Sequence[int], nd_sbp: NdSbp) -> bool:
    """True when every split in ``nd_sbp`` cuts its axis into equal parts."""
    sizes = list(shape)
    for sbp, parts in zip(nd_sbp, mesh, strict=True):
        if isinstance(sbp, Split):
            if sizes[sbp.axis] % parts:
                return False
            sizes[sbp.axis] //= parts
    return True


def partial_weights(parts: int) -> list[float]:
    """Deliberately unequal shares (0.6/0.4 for two) so that a rule that treats P as B is caught."""
    raw = [float(parts + 1 - i) for i in range(parts)]
    total = sum(raw)
    return [r / total for r in raw]


def _partial_share(value: Any, weight_index: int, parts: int) -> Any:
    if np.issubdtype(value.dtype, np.floating):
        return value * value.dtype.type(partial_weights(parts)[weight_index])
    if value.dtype == np.bool_:  # a partial bool is an "or"; sbpflow never makes one, keep it whole
        raise SbpError("a bool tensor cannot be partial-sum; use B or S(i)")
    # integer partials: the first rank keeps the remainder so that the sum is exact
    share = value // parts
    return value - share * (parts - 1) if weight_index == 0 else share


def shard(value: Any, placement: Placement, nd_sbp: NdSbp) -> dict[int, Any]:
    """Cut a logical array into each rank's local array (P entries get unequal shares)."""
    out = {}
    for coord in placement.coords():
        local = value[shard_index(value.shape, placement.shape, nd_sbp, coord)]
        for axis, (sbp, parts) in enumerate(zip(nd_sbp, placement.shape, strict=True)):
            if isinstance(sbp, PartialSum):
                local = _partial_share(local, coord[axis], parts)
        out[placement.rank_at(coord)] = local.copy()
    return out


def assemble(
    shards: Mapping[int, Any],
    shape: Shape,
    placement: Placement,
    nd_sbp: NdSbp,
    xp: ModuleType = np,
    check_broadcast: bool = True,
    rtol: float = 1e-9,
    atol: float = 1e-12,
) -> Any:
    """Rebuild the logical array from each rank's local array: concatenate splits, sum partials.

    With ``check_broadcast`` the copies that ``B`` says are equal are compared, so a wrong rule cannot
    hide behind the copy that happens to be read.
    """
    first = shards[placement.ranks[0]]
    out = xp.zeros(shape, dtype=first.dtype)
    for coord in placement.coords():
        rank = placement.rank_at(coord)
        local = shards[rank]
        index = shard_index(shape, placement.shape, nd_sbp, coord)
        expected = tuple(s.stop - s.start for s in index)
        if tuple(local.shape) != expected:
            raise SbpError(
                f"rank {rank} holds shape {tuple(local.shape)} but {format_nd(nd_sbp)} of {list(shape)} "
                f"gives it {list(expected)}"
            )
        is_rep = all(c == 0 for c, s in zip(coord, nd_sbp, strict=True) if isinstance(s, Broadcast))
        if is_rep:
            out[index] += local
        elif check_broadcast:
            rep = tuple(0 if isinstance(s, Broadcast) else c for c, s in zip(coord, nd_sbp, strict=True))
            ref = shards[placement.rank_at(rep)]
            if not _close(xp, ref, local, rtol, atol):
                raise SbpError(
                    f"ranks {placement.rank_at(rep)} and {rank} should hold equal copies under "
                    f"{format_nd(nd_sbp)} but differ"
                )
    return out


def _close(xp: ModuleType, a: Any, b: Any, rtol: float, atol: float) -> bool:
    if a.dtype.kind in "fc":
        return bool(xp.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
    return bool(xp.array_equal(a, b))


class Declared(Protocol):
    """What :func:`assemble_value` reads of a tensor's declaration (``sbpflow.graph.TensorDecl`` has it)."""

    @property
    def meta(self) -> TensorMeta: ...
    @property
    def placement(self) -> Placement | None: ...
    @property
    def sbp(self) -> NdSbp | None: ...


def assemble_value(decl: Declared, values: dict[int, Any], xp: Any = np) -> Any:
    """The logical value of ``decl`` from each rank's shard (splits concatenated, partials summed,
    broadcast copies checked equal)."""
    assert decl.placement is not None and decl.sbp is not None
    if xp is np:  # shards on a GPU come to the host first
        values = {r: asnumpy(v) for r, v in values.items()}
    first = values[decl.placement.ranks[0]]
    rtol = 1e-9 if first.dtype == np.float64 else 1e-5
    return assemble(values, decl.meta.shape, decl.placement, decl.sbp, xp, rtol=rtol, atol=rtol * 1e-3)
