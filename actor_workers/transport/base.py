"""The data-plane contract: point-to-point messages and the collectives that boxing steps call.

Every transport (in-process threads, CPU shared memory/TCP, NCCL) implements :class:`Transport`. The
rules an implementation keeps:

- Collectives on one group are called in the same order by every member (the plan's communicator order
  guarantees it); the k-th call of each member meets the k-th call of the others. ``tag`` labels a call
  (e.g. the task id): members that disagree on the op, the tag, the group order or the shapes get a
  :class:`TransportError` that names both sides.
- Results never alias an input or another rank's result: a caller may mutate what it gets back.
- Arrays are plain numeric (bool, integers, floats): any other dtype is refused with a TransportError.
- Splits follow :func:`sbpflow.sharding.split_range`, so uneven sizes (a dim of 10 over 4) are legal.
- Every blocking wait has a timeout, and ``abort(reason)`` makes every blocked or later call on every rank
  of the world raise ``TransportError(reason)`` promptly.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from sbpflow.errors import SbpflowError
from sbpflow.sharding import split_range

Group = tuple[int, ...]
Array = NDArray[np.generic]


class TransportError(SbpflowError):
    """A transport call failed: a timeout, mismatched collectives, an abort, a bad argument."""


class TransportAborted(TransportError):
    """Raised by every call after ``abort(reason)``; the message is the reason, verbatim."""


@runtime_checkable
class Transport(Protocol):
    """One rank's view of the data plane."""

    rank: int

    def send(self, array: Array, dst: int, tag: str) -> None:
        """Queue a copy of ``array`` for ``dst``; messages of one (src, dst, tag) arrive in order."""
        ...

    def recv(self, src: int, tag: str) -> Array:
        """The oldest message from ``src`` under ``tag``, waiting for it if none has arrived."""
        ...

    def all_reduce(self, array: Array, group: Group, tag: str) -> Array:
        """The elementwise sum of every member's array (same shape and dtype on every member)."""
        ...

    def reduce_scatter(self, array: Array, group: Group, axis: int, tag: str) -> Array:
        """Member i of ``group`` gets part i (``split_range``) along ``axis`` of the sum."""
        ...

    def all_gather(self, array: Array, group: Group, axis: int, tag: str) -> Array:
        """Every member's array concatenated along ``axis`` in group order; sizes along it may differ."""
        ...

    def all_to_all(self, array: Array, group: Group, split_axis: int, concat_axis: int, tag: str) -> Array:
        """Cut along ``split_axis`` into len(group) parts, part j to member j, concatenate along
        ``concat_axis`` in group order (``S(split_axis)`` of the result from ``S(concat_axis)``)."""
        ...

    def broadcast(self, array: Array | None, root: int, group: Group, tag: str) -> Array:
        """A copy of ``root``'s array on every member; the others' ``array`` is ignored."""
        ...

    def abort(self, reason: str) -> None:
        """Fail every blocked and later call on every rank of the world with ``TransportError(reason)``."""
        ...

    def close(self) -> None:
        """Release this rank's resources; later calls on this rank raise."""
        ...


def check_movable(rank: int, array: Array, what: str) -> None:
    """Transports move plain numeric arrays (bool, integers, floats, bfloat16); refuse anything else."""
    dtype = array.dtype
    if dtype.hasobject or (dtype.kind in "OSUVMm" and dtype.name != "bfloat16"):
        raise TransportError(
            f"rank {rank}: {what}: transports move plain numeric arrays; got dtype {dtype}: convert it to "
            "one of float16, bfloat16, float32, float64, int32, int64 or bool"
        )


def check_broadcast(rank: int, array: object, root: int, group: Group, tag: str) -> Group:
    """The group as a tuple, after the argument checks every transport's broadcast makes."""
    group = tuple(group)
    if root not in group:
        raise TransportError(f"rank {rank}: broadcast tag {tag!r} from root {root}, not in group {group}")
    if root == rank and array is None:
        raise TransportError(f"rank {rank}: broadcast tag {tag!r}: the root must pass an array")
    return group


def part(array: Array, axis: int, parts: int, i: int) -> Array:
    """Part ``i`` of ``parts`` of ``array`` along ``axis`` (a view), cut the way sharding cuts."""
    lo, hi = split_range(array.shape[axis], parts, i)
    return array[(slice(None),) * axis + (slice(lo, hi),)]
