"""The NCCL transport's wire format: the dtype table, the call headers and the check of one header round.

Pure numpy; nothing here needs cupy, so it is tested on any machine.

- **Dtypes.** :data:`NCCL_TYPES` maps a numpy dtype to NCCL's ``ncclDataType_t`` and the ``ncclRedOp_t``
  that sums it; :data:`NOT_MOVABLE` lists the sbpflow dtypes it leaves out, and why.
- **Headers.** Every collective first all-gathers a small int64 header per member (op, tag, axes, dtype,
  shape, call number): members that disagree get a :class:`TransportError` naming both sides
  (:func:`check_round`) instead of garbage or a hang, and all-gather / all-to-all / broadcast learn the
  other members' shapes. A point-to-point message is its header, then its payload.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport.base import Group, TransportError
from sbpflow.dtype import DType, bfloat16_numpy
from sbpflow.errors import ShapeError

# -- dtypes: numpy dtype -> NCCL's ncclDataType_t, and the ncclRedOp_t that sums it -----------------
# The values are nccl.h's (a stable ABI), so the table is usable, and testable, without cupy.

SUM, MAX = 0, 2  # ncclSum, ncclMax


@dataclass(frozen=True, slots=True)
class NcclType:
    code: int  # ncclDataType_t
    reduce: int  # the ncclRedOp_t of a sum (bool: max, the logical or that numpy's add gives bools)
    name: str


NCCL_TYPES: dict[np.dtype[Any], NcclType] = {
    np.dtype(np.bool_): NcclType(1, MAX, "ncclUint8"),
    np.dtype(np.int8): NcclType(0, SUM, "ncclInt8"),
    np.dtype(np.uint8): NcclType(1, SUM, "ncclUint8"),
    np.dtype(np.int32): NcclType(2, SUM, "ncclInt32"),
    np.dtype(np.uint32): NcclType(3, SUM, "ncclUint32"),
    np.dtype(np.int64): NcclType(4, SUM, "ncclInt64"),
    np.dtype(np.uint64): NcclType(5, SUM, "ncclUint64"),
    np.dtype(np.float16): NcclType(6, SUM, "ncclFloat16"),
    np.dtype(np.float32): NcclType(7, SUM, "ncclFloat32"),
    np.dtype(np.float64): NcclType(8, SUM, "ncclFloat64"),
}
# sbpflow dtypes the table leaves out, and why (every other DType is in NCCL_TYPES)
NOT_MOVABLE: dict[DType, str] = {}
try:  # bfloat16 arrays are ml_dtypes' (cupy's bfloat16 is numpy's, where ml_dtypes is installed)
    NCCL_TYPES[bfloat16_numpy()] = NcclType(9, SUM, "ncclBfloat16")  # cupy.cuda.nccl has no constant for it
except ShapeError as e:
    NOT_MOVABLE[DType.bfloat16] = str(e)


def nccl_type(dtype: Any) -> NcclType:
    """The NCCL type of a numpy/cupy dtype, or a TransportError listing the ones NCCL moves."""
    found = NCCL_TYPES.get(np.dtype(dtype))
    if found is None:
        raise TransportError(
            f"the NCCL transport cannot move dtype {np.dtype(dtype)}; it moves {sorted(d.name for d in NCCL_TYPES)}: "
            "cast the tensor (e.g. to float32) before it crosses devices"
        )
    return found


# -- headers: what each member says about its call, all-gathered before the payload -----------------

MAX_NDIM, TAG_BYTES = 16, 48
_FIXED = 8  # op, tag hash, meta[0], meta[1], dtype, ndim, call number, tag length
HEADER_WORDS = _FIXED + TAG_BYTES // 8 + MAX_NDIM
DTYPES = tuple(NCCL_TYPES)  # a header's dtype code is the index here


def tag_hash(tag: str) -> int:
    """A stable signed 64-bit hash of a tag (the header carries it beside the tag's first bytes)."""
    return int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little", signed=True)


@dataclass(frozen=True, slots=True)
class Header:
    op: str
    tag: str  # the first TAG_BYTES bytes of the tag
    tag_hash: int  # of the whole tag
    meta: tuple[int, ...]  # axis / (split_axis, concat_axis) / root position
    dtype: np.dtype[Any] | None  # None: no array (broadcast, not the root)
    shape: tuple[int, ...] | None
    call: int  # this member's call number on the communicator

    def describe(self) -> str:
        names = OPS[self.op].meta_names
        args = "".join(f", {n}={v}" for n, v in zip(names, self.meta, strict=True))
        array = "no array" if self.shape is None else f"{self.dtype}{list(self.shape)}"
        return f"{self.op}(tag={self.tag!r}, call #{self.call}{args}, {array})"


def encode(
    op: str, tag: str, meta: tuple[int, ...], dtype: Any, shape: tuple[int, ...] | None, call: int
) -> np.ndarray:
    """The int64 header words of one call (see :class:`Header`)."""
    if shape is not None and len(shape) > MAX_NDIM:
        raise TransportError(
            f"the NCCL transport moves arrays of at most {MAX_NDIM} dims, got shape {list(shape)}"
        )
    w = np.full(HEADER_WORDS, -1, np.int64)
    raw = tag.encode()[:TAG_BYTES]
    w[0], w[1], w[6], w[7] = list(OPS).index(op), tag_hash(tag), call, len(raw)
    w[2 : 2 + len(meta)] = meta
    if shape is not None:
        w[4], w[5] = DTYPES.index(np.dtype(dtype)), len(shape)
        w[_FIXED + TAG_BYTES // 8 : _FIXED + TAG_BYTES // 8 + len(shape)] = shape
    w[_FIXED : _FIXED + TAG_BYTES // 8] = np.frombuffer(raw.ljust(TAG_BYTES, b"\0"), "<i8")
    return w


def decode(words: np.ndarray) -> Header:
    w = [int(v) for v in words]
    op = list(OPS)[w[0]]
    tag = (
        np.asarray(words[_FIXED : _FIXED + TAG_BYTES // 8], "<i8").tobytes()[: w[7]].decode(errors="replace")
    )
    shape = None if w[5] < 0 else tuple(w[_FIXED + TAG_BYTES // 8 : _FIXED + TAG_BYTES // 8 + w[5]])
    dtype = None if w[4] < 0 else DTYPES[w[4]]
    return Header(op, tag, w[1], tuple(w[2 : 2 + len(OPS[op].meta_names)]), dtype, shape, w[6])


def same_call(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two header words describe the same call but for its number (word 6)."""
    keep = np.arange(HEADER_WORDS) != 6
    return bool(np.array_equal(a[keep], b[keep]))


def _equal_shapes(a: Header, b: Header) -> bool:
    return (a.dtype, a.shape) == (b.dtype, b.shape)


def _equal_but(meta_index: int) -> Callable[[Header, Header], bool]:
    """Shapes agree except along the axis ``meta[meta_index]``, where members' sizes may differ."""

    def agree(a: Header, b: Header) -> bool:
        if a.shape is None or b.shape is None or a.dtype != b.dtype or len(a.shape) != len(b.shape):
            return False
        free = a.meta[meta_index]
        return all(p == q for i, (p, q) in enumerate(zip(a.shape, b.shape, strict=True)) if i != free)

    return agree


@dataclass(frozen=True)
class _OpInfo:
    meta_names: tuple[str, ...]
    agree: Callable[[Header, Header], bool]  # do two members' arrays fit together


OPS: dict[str, _OpInfo] = {
    "send": _OpInfo((), lambda a, b: True),
    "all_reduce": _OpInfo((), _equal_shapes),
    "reduce_scatter": _OpInfo(("axis",), _equal_shapes),
    "all_gather": _OpInfo(("axis",), _equal_but(0)),
    "all_to_all": _OpInfo(("split_axis", "concat_axis"), _equal_but(1)),
    "broadcast": _OpInfo(("root_pos",), lambda a, b: True),  # only the root's array counts
}


def check_round(headers: Sequence[Header], group: Group) -> None:
    """Raise a TransportError naming both sides when the members' calls of one round disagree."""
    first = headers[0]
    for rank, h in zip(group[1:], headers[1:], strict=True):
        same = (h.op, h.tag_hash, h.meta, h.call) == (first.op, first.tag_hash, first.meta, first.call)
        if not (same and OPS[h.op].agree(first, h)):
            raise TransportError(
                f"a collective of group {group} does not match: rank {group[0]} called {first.describe()} but rank "
                f"{rank} called {h.describe()}; every member must issue the same collectives on a group in the "
                "same order (the plan's communicator order), with the same tag, group order and agreeing shapes"
            )
