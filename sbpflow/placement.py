"""Placement: the device type and the ranks of a global tensor, as a 1-d or n-d grid (a mesh)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from numbers import Integral
from typing import Any

from sbpflow.errors import PlacementError

DEVICE_TYPES = ("cpu", "cuda")


def _grid_shape(ranks: Any) -> tuple[int, ...]:
    """Shape of a nested list of ints; refuses ragged grids."""
    if _is_int(ranks):
        return ()
    if not isinstance(ranks, Sequence) or isinstance(ranks, str) or len(ranks) == 0:
        raise PlacementError(f"ranks must be a non-empty (nested) list of ints, got {ranks!r}")
    shapes = {_grid_shape(r) for r in ranks}
    if len(shapes) != 1:
        raise PlacementError(f"ranks {ranks!r} form a ragged grid; every row needs the same length")
    return (len(ranks), *shapes.pop())


def _is_int(x: Any) -> bool:
    """Python and numpy integers alike (a rank list often comes from np.arange); never bools."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def _flatten(ranks: Any) -> list[int]:
    if _is_int(ranks):
        return [int(ranks)]
    return [r for sub in ranks for r in _flatten(sub)]


@dataclass(frozen=True, slots=True)
class Placement:
    """``device_type`` and ``ranks`` (row-major over ``shape``); ``shape`` has one entry per mesh axis."""

    device_type: str
    ranks: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.device_type not in DEVICE_TYPES:
            raise PlacementError(f"device type {self.device_type!r} is unknown; use one of {DEVICE_TYPES}")
        if not self.shape or any(d <= 0 for d in self.shape):
            raise PlacementError(f"placement mesh shape {self.shape} must be non-empty with positive sizes")
        size = 1
        for d in self.shape:
            size *= d
        if size != len(self.ranks):
            raise PlacementError(
                f"mesh shape {self.shape} holds {size} ranks but {len(self.ranks)} were given"
            )
        if any(r < 0 for r in self.ranks):
            raise PlacementError(f"ranks {list(self.ranks)} include a negative rank; ranks start at 0")
        seen: set[int] = set()
        dups = sorted({r for r in self.ranks if r in seen or seen.add(r)})  # type: ignore[func-returns-value]
        if dups:
            raise PlacementError(
                f"placement ranks {list(self.ranks)} repeat rank(s) {dups}; each rank may appear once"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def coords(self) -> list[tuple[int, ...]]:
        """Mesh coordinates in the row-major order of ``ranks``."""
        return list(product(*(range(d) for d in self.shape)))

    def coord_of(self, rank: int) -> tuple[int, ...]:
        try:
            i = self.ranks.index(rank)
        except ValueError:
            raise PlacementError(f"rank {rank} is not in {self}") from None
        return self.coords()[i]

    def rank_at(self, coord: Sequence[int]) -> int:
        if len(coord) != self.ndim or any(not 0 <= c < d for c, d in zip(coord, self.shape, strict=True)):
            raise PlacementError(f"mesh coordinate {tuple(coord)} is outside the {self.shape} mesh of {self}")
        i = 0
        for c, d in zip(coord, self.shape, strict=True):
            i = i * d + c
        return self.ranks[i]

    def grid(self) -> Any:
        """The ranks as the nested list they were given as."""

        def build(flat: list[int], shape: tuple[int, ...]) -> Any:
            if len(shape) == 1:
                return flat
            step = len(flat) // shape[0]
            return [build(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]

        return build(list(self.ranks), self.shape)

    def __repr__(self) -> str:
        return f"placement(type={self.device_type!r}, ranks={self.grid()})"


def placement(device_type: str = "cpu", ranks: Any = (0,)) -> Placement:
    """``sf.placement("cpu", ranks=[0, 1])`` or a 2x2 mesh ``ranks=[[0, 1], [2, 3]]``."""
    if isinstance(ranks, range):
        ranks = list(ranks)
    shape = _grid_shape(ranks)
    if shape == ():
        shape, flat = (1,), [ranks]
    else:
        flat = _flatten(ranks)
    for r in flat:
        if not _is_int(r):
            raise PlacementError(f"rank {r!r} is not an int; ranks are device indices like [0, 1, 2, 3]")
    return Placement(device_type, tuple(flat), shape)
