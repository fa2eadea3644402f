"""Tensor metadata: the logical shape and dtype, and, for a global tensor, its placement and nd-SBP."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TypeAlias

from sbpflow.dtype import DType
from sbpflow.placement import Placement
from sbpflow.sbp import NdSbp, as_nd, check_axes, format_nd

Shape: TypeAlias = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What shape and dtype inference computes: a logical (global) shape and a dtype."""

    shape: Shape
    dtype: DType

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"[{', '.join(map(str, self.shape))}] {self.dtype.value}"


@dataclass(frozen=True, slots=True)
class GlobalMeta:
    """A global tensor: logical metadata laid out over ``placement`` by ``sbp`` (one entry per mesh axis)."""

    meta: TensorMeta
    placement: Placement
    sbp: NdSbp

    def __post_init__(self) -> None:
        as_nd(self.sbp, self.placement.ndim)  # one SBP per mesh axis, or a clear error
        check_axes(self.sbp, self.meta.ndim, f"tensor {self.meta}")

    def __repr__(self) -> str:
        return f"{self.meta} {format_nd(self.sbp)} on {self.placement}"
