"""Where a memory plan's values lie: one arena, each planned value at an offset of its own, values whose
lifetimes overlap on bytes apart (:func:`pack`).

A value's place is chosen greedily (Pisarchyk & Lee, "Efficient memory management for deep neural net
inference", 2020): in decreasing size (ties by birth), each value goes at the start of the smallest gap
that holds it among the values already placed whose lifetimes overlap its own, else above them all; the
same in decreasing lifetime length, and the smaller arena of the two is kept. Values that never live
together may then share bytes in part (a large value's bytes hold two smaller ones later in the step),
which buffers of one value at a time cannot: ResNet-18's planned values take 15.2 MB of arena where a
buffer per colour (first-fit in decreasing size) took 19.6 MB, the most alive at once being 15.0 MB;
BERT's 175.3 MB where colours took 177.3 (174.4), the main job's 12.4 (12.6; 12.1).

Each value starts 64-byte aligned; a large one (:data:`STAGGERED` bytes or more) takes 4 KB more and is
shifted within them by its own multiple of 64 bytes, so that a kernel reading one value and writing
another does not meet 4K aliasing (both at one address mod 4096: BERT's GELU loop took 6.5 ms, not
1.9). Every large value of one size takes as many bytes, so that it fits where another of its size was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

ALIGN = 64
STAGGER = 4096  # a large value's start is staggered within this many bytes
STAGGERED = 16384  # values of this many bytes or more are staggered


@dataclass(frozen=True)
class Lifetime:
    """A register's value within a step: from its producer's position to its last consumer's.
    ``readers``: the reads of the value (through pass-through steps) and of its views, ``aliases``: the
    registers of those steps, which carry the same value (0 and () for a register read directly only),
    ``views``: (register, reads below it) of each view of it (``memory_plan.Followed``)."""

    register: int
    nbytes: int
    first: int
    last: int
    readers: int = 0
    aliases: tuple[int, ...] = ()
    views: tuple[tuple[int, int], ...] = ()

    def overlaps(self, other: Lifetime) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass(frozen=True)
class Place:
    """A value's bytes in the arena: ``start`` (its first byte, 64-byte aligned), ``nbytes`` (its own);
    ``end`` is where the next place may begin (its stagger included)."""

    start: int
    nbytes: int
    end: int

    def meets(self, other: Place) -> bool:
        return self.start < other.start + other.nbytes and other.start < self.start + self.nbytes


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(lifetimes: Sequence[Lifetime]) -> tuple[dict[int, Place], int]:
    """Register -> its :class:`Place`, and the arena's bytes (see the module docstring)."""
    by_size = sorted(lifetimes, key=lambda x: (-x.nbytes, x.first, x.register))
    by_length = sorted(lifetimes, key=lambda x: (x.first - x.last, -x.nbytes, x.first, x.register))
    return min((_greedy(order) for order in (by_size, by_length)), key=lambda packed: packed[1])


def _greedy(order: Sequence[Lifetime]) -> tuple[dict[int, Place], int]:
    n = len(order)
    firsts = np.array([x.first for x in order], np.int64)
    lasts = np.array([x.last for x in order], np.int64)
    starts = np.zeros(n, np.int64)  # a placed value's bytes, stagger included: [starts, ends)
    ends = np.zeros(n, np.int64)
    places: dict[int, Place] = {}
    top = 0
    for i, life in enumerate(order):
        large = life.nbytes >= STAGGERED
        shift = ALIGN * (i * 23 % (STAGGER // ALIGN)) if large else 0
        size = _round(life.nbytes) + (STAGGER if large else 0)
        live = np.flatnonzero((firsts[:i] <= life.last) & (life.first <= lasts[:i]))
        at = _gap(starts[live], ends[live], size)
        starts[i], ends[i] = at, at + size
        places[life.register] = Place(at + shift, life.nbytes, at + size)
        top = max(top, at + size)
    return places, top


def _gap(starts: np.ndarray, ends: np.ndarray, size: int) -> int:
    """The start of the smallest gap of at least ``size`` bytes between the ranges [starts, ends) (ties:
    the lowest), else the end of the highest."""
    best, at, below = None, 0, 0
    for s, e in sorted(zip(starts.tolist(), ends.tolist(), strict=True)):
        if s - below >= size and (best is None or s - below < best):
            best, at = s - below, below
        below = max(below, e)
    return at if best is not None else below


def meeting(places: Mapping[int, Place]) -> dict[int, list[int]]:
    """Register -> the registers whose bytes meet its own (never itself): the values to be dead before
    it is lent its place. A sweep by start: only the places that began below one's end can meet it."""
    order = sorted(places, key=lambda r: places[r].start)
    out: dict[int, list[int]] = {r: [] for r in order}
    open_: list[int] = []
    for r in order:
        p = places[r]
        open_ = [q for q in open_ if places[q].start + places[q].nbytes > p.start]
        for q in open_:
            out[r].append(q)
            out[q].append(r)
        open_.append(r)
    return out
