"""A step's loss assembled as its ranks' shares come, not all at once when the last one does.

:func:`sbpflow.sharding.assemble_value` rebuilds a tensor from every rank's shard in one go: for each
mesh coordinate, in row-major order, it checks the shard's shape, adds a replica's shard into the
result and compares a broadcast copy with its replica. Over 1,024 ranks that is ~30 ms of Python, and
the step tracker paid it under its lock on the report that completed the step, holding the GIL while
Get waited. Here the same work is split: :class:`ShareLayout` works out each coordinate's slices, shape
and replica once per loss declaration, and :class:`ShareAssembly` folds each shard in as soon as every
coordinate before it has been folded. The adds are the same adds in the same order, so the value is
bit-identical to ``assemble_value``'s (a test checks it over arrival orders, meshes and SBPs), and a
wrong shard raises the same ``SbpError``.

    layout = ShareLayout(decl)
    a = ShareAssembly(layout)
    a.add(rank, share)  # any order; True once every rank's share is in
    a.value()           # the logical value
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.device import asnumpy
from sbpflow.errors import SbpError
from sbpflow.graph import TensorDecl
from sbpflow.sbp import Broadcast, format_nd
from sbpflow.sharding import shard_index


@dataclass(frozen=True)
class _Coord:
    """One mesh coordinate of the loss's placement: its rank, what it holds, and its replica's rank."""

    rank: int
    index: tuple[slice, ...]
    shape: tuple[int, ...]
    replica: int  # the rank holding the copy this one must equal (itself: it is added in)


class ShareLayout:
    """Where each rank's share of ``decl`` goes, in the row-major order ``assemble`` adds them."""

    def __init__(self, decl: TensorDecl) -> None:
        if decl.placement is None or decl.sbp is None:
            raise SbpError(f"tensor {decl.name!r} has no placement or SBP; its shares cannot be assembled")
        pl, nd, shape = decl.placement, decl.sbp, decl.meta.shape
        coords = []
        for coord in pl.coords():
            index = shard_index(shape, pl.shape, nd, coord)
            rep = tuple(0 if isinstance(s, Broadcast) else c for c, s in zip(coord, nd, strict=True))
            shard = tuple(s.stop - s.start for s in index)
            coords.append(_Coord(pl.rank_at(coord), index, shard, pl.rank_at(rep)))
        self.coords = tuple(coords)
        self.ranks = frozenset(c.rank for c in coords)
        self.shape, self.sbp = tuple(shape), format_nd(nd)


class ShareAssembly:
    """One tensor's shares, folded into its value in ``assemble``'s order as soon as they can be."""

    def __init__(self, layout: ShareLayout) -> None:
        self._layout = layout
        self._shares: dict[int, np.ndarray] = {}
        self._folded = 0  # coordinates added (or checked) so far, in order
        self._out: np.ndarray | None = None
        self._rtol = 0.0

    def add(self, rank: int, share: Any) -> bool:
        """Rank ``rank``'s share (a rank not in the placement is ignored; a share folded in already is
        kept); True once every share is in."""
        if rank in self._layout.ranks and rank not in self._shares:
            self._shares[rank] = asnumpy(share)  # a GPU shard comes to the host, as in assemble_value
            self._fold()
        return self.complete

    @property
    def complete(self) -> bool:
        return self._folded == len(self._layout.coords)

    def value(self) -> np.ndarray:
        """The logical value; every share must be in."""
        if self._out is None or not self.complete:
            missing = sorted(self._layout.ranks - self._shares.keys())
            raise SbpError(f"the tensor's shares of ranks {missing[:8]} are missing; it is not assembled yet")
        return self._out

    def _fold(self) -> None:
        coords = self._layout.coords
        while self._folded < len(coords) and coords[self._folded].rank in self._shares:
            c = coords[self._folded]
            local = self._shares[c.rank]
            if self._out is None:  # the first coordinate's share sets the dtype, as in assemble_value
                self._out = np.zeros(self._layout.shape, dtype=local.dtype)
                self._rtol = 1e-9 if local.dtype == np.float64 else 1e-5
            if tuple(local.shape) != c.shape:
                raise SbpError(
                    f"rank {c.rank} holds shape {tuple(local.shape)} but {self._layout.sbp} of "
                    f"{list(self._layout.shape)} gives it {list(c.shape)}"
                )
            if c.replica == c.rank:
                self._out[c.index] += local
            elif not _close(self._shares[c.replica], local, self._rtol, self._rtol * 1e-3):
                raise SbpError(
                    f"ranks {c.replica} and {c.rank} should hold equal copies under {self._layout.sbp} "
                    "but differ"
                )
            self._folded += 1


def _close(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> bool:
    """``assemble``'s comparison of two broadcast copies."""
    if a.dtype.kind in "fc":
        return bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
    return bool(np.array_equal(a, b))
