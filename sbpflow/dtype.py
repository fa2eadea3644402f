"""Element types. Names are the wire names; each maps to the array library's dtype where it has one."""

from __future__ import annotations

import builtins
from enum import StrEnum
from typing import Any

import numpy as np

from sbpflow.errors import ShapeError


class DType(StrEnum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"
    float64 = "float64"
    int32 = "int32"
    int64 = "int64"
    bool = "bool"

    def __repr__(self) -> str:
        return f"sf.{self.value}"

    __str__ = __repr__

    @property
    def is_floating(self) -> builtins.bool:  # `bool` is a member name in this class body
        return self in _FLOATING

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    def to_numpy(self) -> np.dtype[Any]:
        if self is DType.bfloat16:
            return bfloat16_numpy()
        return np.dtype(self.value)


_FLOATING = {DType.float16, DType.bfloat16, DType.float32, DType.float64}
_ITEMSIZE = {
    DType.float16: 2,
    DType.bfloat16: 2,
    DType.float32: 4,
    DType.float64: 8,
    DType.int32: 4,
    DType.int64: 8,
    DType.bool: 1,
}


def bfloat16_numpy() -> np.dtype[Any]:
    """numpy's bfloat16 (``ml_dtypes``'), which cupy uses too where it has bfloat16 arrays."""
    try:
        import ml_dtypes
    except ImportError:
        raise ShapeError(
            "bfloat16 on numpy needs ml_dtypes, which is not installed: pip install ml_dtypes (a runtime "
            "dependency of sbpflow), or choose float16/float32"
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def as_dtype(value: Any) -> DType:
    """Accept a DType, its name, or a numpy dtype."""
    if isinstance(value, DType):
        return value
    name = np.dtype(value).name if not isinstance(value, str) else value
    try:
        return DType(name)
    except ValueError:
        raise ShapeError(f"dtype {value!r} is not supported; use one of {[d.value for d in DType]}") from None


float16, bfloat16, float32, float64 = DType.float16, DType.bfloat16, DType.float32, DType.float64
int32, int64 = DType.int32, DType.int64
