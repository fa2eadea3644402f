"""SBP values: how one logical tensor lies on the ranks of one placement axis.

``S(axis)`` splits the tensor along ``axis``, ``B`` gives every rank the whole tensor and ``P`` gives every
rank a partial value whose sum over the ranks is the tensor. They are plain values: they print as OneFlow
and DTensor print them and do no communication themselves. An *nd-SBP* is a tuple with one entry per
placement (mesh) axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from numbers import Integral
from typing import TypeAlias

from sbpflow.errors import SbpError


@dataclass(frozen=True, slots=True)
class Split:
    axis: int

    def __post_init__(self) -> None:
        if isinstance(self.axis, Integral) and not isinstance(self.axis, bool):
            object.__setattr__(self, "axis", int(self.axis))  # np.int64(1) -> 1, so equal SBPs hash equal
        if not isinstance(self.axis, int) or isinstance(self.axis, bool) or self.axis < 0:
            raise SbpError(f"split axis must be a non-negative int, got {self.axis!r}; write sf.sbp.split(0)")

    def __repr__(self) -> str:
        return f"S({self.axis})"


@dataclass(frozen=True, slots=True)
class Broadcast:
    def __repr__(self) -> str:
        return "B"


@dataclass(frozen=True, slots=True)
class PartialSum:
    def __repr__(self) -> str:
        return "P"


Sbp: TypeAlias = Split | Broadcast | PartialSum
NdSbp: TypeAlias = tuple[Sbp, ...]

B = Broadcast()
P = PartialSum()


def S(axis: int) -> Split:  # noqa: N802 - the name is the notation
    return Split(axis)


# The user-facing spellings, as in OneFlow: ``sf.sbp.split(0)``, ``sf.sbp.broadcast``, ``sf.sbp.partial_sum``.
split = S
broadcast = B
partial_sum = P

_TEXT = re.compile(r"^\s*(?:S\((\d+)\)|(B)|(P))\s*$")


def parse(text: str) -> Sbp:
    """``"S(1)"`` -> ``S(1)``; the inverse of ``repr``."""
    m = _TEXT.match(text)
    if not m:
        raise SbpError(f"cannot parse SBP {text!r}; expected one of 'S(<axis>)', 'B', 'P'")
    if m.group(1) is not None:
        return Split(int(m.group(1)))
    return B if m.group(2) else P


def as_nd(sbp: Sbp | NdSbp | list[Sbp], ndim: int) -> NdSbp:
    """Normalise a single SBP or a sequence to an nd-SBP of ``ndim`` entries (one per mesh axis)."""
    if isinstance(sbp, (Split, Broadcast, PartialSum)):
        nd: NdSbp = (sbp,) * ndim
    else:
        nd = tuple(sbp)
        for s in nd:
            if not isinstance(s, (Split, Broadcast, PartialSum)):
                raise SbpError(
                    f"{s!r} is not an SBP; use sf.sbp.split(i), sf.sbp.broadcast or sf.sbp.partial_sum"
                )
    if len(nd) != ndim:
        raise SbpError(
            f"nd-SBP {format_nd(nd)} has {len(nd)} entries but the placement has {ndim} mesh axes; "
            "give one SBP per mesh axis"
        )
    return nd


def format_nd(nd: NdSbp) -> str:
    return repr(nd[0]) if len(nd) == 1 else "(" + ", ".join(map(repr, nd)) + ")"


def check_axes(nd: NdSbp, tensor_ndim: int, what: str = "tensor") -> None:
    """Refuse a split of an axis the tensor does not have."""
    for s in nd:
        if isinstance(s, Split) and s.axis >= tensor_ndim:
            raise SbpError(
                f"{s!r} splits axis {s.axis} of {what}, which has only {tensor_ndim} axes; "
                f"use an axis in 0..{tensor_ndim - 1} or sf.sbp.broadcast"
            )
