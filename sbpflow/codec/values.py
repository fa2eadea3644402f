"""The wire's small values, shared by every converter of the codec: its error, element types both ways
and dense arrays (``ArrayData``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import SbpflowError
from sbpflow.limits import check_shape
from sbpflow.v1 import job_pb2 as pb


class WireError(SbpflowError, ValueError):
    """A protobuf that does not describe a valid job."""


_DTYPE = {d: getattr(pb, f"DTYPE_{d.name.upper()}") for d in DType}


def inverse(table: Mapping[Any, int], what: str) -> Any:
    inv = {v: k for k, v in table.items()}

    def lookup(value: int) -> Any:
        if value not in inv:
            raise WireError(f"{what} enum value {value} is unspecified or unknown; set it explicitly")
        return inv[value]

    return lookup


dtype_from_proto = inverse(_DTYPE, "DType")


def dtype_to_proto(d: DType) -> pb.DType.ValueType:
    return _DTYPE[d]


def array_to_proto(a: np.ndarray) -> pb.ArrayData:
    return pb.ArrayData(
        dtype=dtype_to_proto(as_dtype(a.dtype)),
        shape=a.shape,
        data=np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes(),
    )


def array_from_proto(m: pb.ArrayData) -> np.ndarray:
    dtype = dtype_from_proto(m.dtype).to_numpy().newbyteorder("<")
    shape = check_shape("ArrayData.shape", m.shape)  # before numpy multiplies it out in int64
    expected = math.prod(shape) * dtype.itemsize
    if len(m.data) != expected:
        raise WireError(
            f"array of shape {list(shape)} {dtype.name} needs {expected} bytes, got {len(m.data)}"
        )
    return np.frombuffer(m.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
