"""The collectives of the CPU transport, built on its point-to-point messages.

The k-th collective of each member on a group (keyed by the group's sorted ranks) is round k; its
messages go to mailbox keys ``c:<group>:<k>:<step>``, one message per (source, key). Step 0 is the
opening exchange: every member sends every other member a message carrying a description of its call
(op, tag, group order, axes, dtype, shape), so any two members that disagree both raise, naming each
other, before any data is combined. Small arrays ride on that exchange (one round trip):

| op | small ((p-1)·|T| <= ``DIRECT_BYTES``) | large |
|---|---|---|
| all_reduce | every member's array to every member, summed in group order | ring reduce-scatter + ring all-gather |
| reduce_scatter | part j to member j, summed in group order | ring reduce-scatter |
| all_gather, all_to_all, broadcast | direct, at any size | |

With two members a small sum is posted before the send (:func:`_pair_sum`): the receive thread adds the
peer's array to this member's straight from the link into the result, so the array is neither copied
out of the link nor summed again by the caller (a + b == b + a exactly, so both get the same bits).

A ring moves (p-1)/p of the array per phase through each member, in chunks that ``split_range`` cuts;
each incoming chunk is added (or copied) by the receive thread straight into the result while the caller
sends. Each chunk of an all-reduce is summed by one member and copied to the others, so every member
gets the same bits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sbpflow.actor_workers.transport.base import Array, Group, TransportError, check_broadcast, part
from sbpflow.actor_workers.transport.cpu.links import as_bytes, encode_dtype
from sbpflow.actor_workers.transport.cpu.mailbox import Message, Posted
from sbpflow.actor_workers.transport.pool import BufferPool
from sbpflow.sharding import split_range


class Messenger(Protocol):
    """What a collective asks of its rank's transport (``transport.CpuTransport``): its mailboxes, the
    sequence number of a group's next call and the buffers large results come from."""

    rank: int
    timeout: float
    pool: BufferPool

    def next_seq(self, group: Group) -> int: ...
    def post_send(
        self, dst: int, key: str, array: np.ndarray, extra: dict[str, Any] | None = None
    ) -> None: ...
    def take(self, src: int, key: str, what: str, deadline: float) -> Message: ...
    def post(
        self, src: int, key: str, dest: np.ndarray, base: np.ndarray | None, dtype: np.dtype[Any]
    ) -> Posted: ...
    def unpost(self, posted: Posted) -> None: ...
    def collect(self, posted: Posted, what: str, deadline: float) -> dict[str, Any]: ...
    def check_members(self, kind: str, tag: str, group: Group) -> int: ...


DIRECT_BYTES = 1 << 20  # bytes a member sends in a direct exchange: (p - 1) x |T|; above it, the ring
NOTHING = np.empty(0, np.uint8)


def contiguous(array: Array) -> np.ndarray:
    a = np.asarray(array, order="C")  # not ascontiguousarray: it makes 0-d 1-d
    encode_dtype(a.dtype)
    return a


# -- agreeing on a call -----------------------------------------------------------------------------


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["d"] == b["d"] and a["s"] == b["s"])


def _same_but(meta_index: int) -> Callable[[dict[str, Any], dict[str, Any]], bool]:
    """Shapes agree except along the axis ``meta[meta_index]``, where members' sizes may differ."""

    def agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
        free, x, y = a["meta"][meta_index], a["s"], b["s"]
        return bool(
            a["d"] == b["d"]
            and len(x) == len(y)
            and all(p == q for i, (p, q) in enumerate(zip(x, y, strict=True)) if i != free)
        )

    return agree


@dataclass(frozen=True)
class _Op:
    meta_names: tuple[str, ...]
    agree: Callable[[dict[str, Any], dict[str, Any]], bool]


_OPS: dict[str, _Op] = {
    "all_reduce": _Op((), _same),
    "reduce_scatter": _Op(("axis",), _same),
    "all_gather": _Op(("axis",), _same_but(0)),
    "all_to_all": _Op(("split_axis", "concat_axis"), _same_but(1)),
    "broadcast": _Op(("root",), lambda a, b: True),  # only the root's array counts
}


def describe(desc: dict[str, Any]) -> str:
    names = _OPS[desc["kind"]].meta_names if desc.get("kind") in _OPS else ()
    args = "".join(f", {n}={v}" for n, v in zip(names, desc.get("meta", ()), strict=False))
    d = desc.get("d")
    shape = "no array" if d is None else f"{d if d == 'bfloat16' else np.dtype(d).name}{list(desc['s'])}"
    return f"{desc.get('kind')}(tag={desc.get('tag')!r}, group={tuple(desc.get('group', ()))}{args}, {shape})"


@dataclass(frozen=True)
class _Call:
    """This member's side of one round."""

    t: Messenger
    desc: dict[str, Any]
    group: Group
    pos: int
    seq: int
    deadline: float

    def key(self, step: int) -> str:
        return f"c:{','.join(map(str, sorted(self.group)))}:{self.seq}:{step}"

    def what(self) -> str:
        return f"{describe(self.desc)} (collective #{self.seq} of group {tuple(sorted(self.group))}) from"

    def check(self, peer: int, theirs: dict[str, Any] | None) -> None:
        mine = self.desc
        ok = isinstance(theirs, dict) and all(
            mine[k] == theirs.get(k) for k in ("kind", "tag", "group", "meta")
        )
        if ok and _OPS[mine["kind"]].agree(mine, theirs):  # type: ignore[arg-type]
            return
        sides = sorted([(self.t.rank, describe(mine)), (peer, describe(theirs or {}))])
        raise TransportError(
            f"collective #{self.seq} of group {tuple(sorted(self.group))} does not match: rank {sides[0][0]} "
            f"called {sides[0][1]} but rank {sides[1][0]} called {sides[1][1]}; every member must issue "
            "the same collectives on a group in the same order (the plan's communicator order), with the "
            "same tag, group order and agreeing shapes"
        )

    def peers(self, back: bool = False) -> list[int]:
        """The other members, starting after (or, ``back``, before) this one, so sends spread out."""
        n = len(self.group)
        return [self.group[(self.pos - k if back else self.pos + k) % n] for k in range(1, n)]

    def exchange(self, payload: Callable[[int], np.ndarray] | None) -> dict[int, np.ndarray]:
        """Step 0: send ``payload(peer)`` (or nothing) with this call's description to every other
        member, take theirs and check that they agree; returns each peer's array."""
        for peer in self.peers():
            self.t.post_send(
                peer, self.key(0), NOTHING if payload is None else payload(peer), {"c": self.desc}
            )
        got = {}
        for peer in self.peers(back=True):
            message = self.t.take(peer, self.key(0), self.what(), self.deadline)
            self.check(peer, message.meta.get("c"))
            got[peer] = message.array
        return got

    def ring_step(self, step: int, send: np.ndarray, dest: np.ndarray, base: np.ndarray | None) -> None:
        """Send ``send`` to the next member while the previous member's chunk lands in ``dest`` (flat
        arrays), added to ``base`` if given."""
        n = len(self.group)
        prev, nxt = self.group[(self.pos - 1) % n], self.group[(self.pos + 1) % n]
        key = self.key(step)
        posted = self.t.post(prev, key, as_bytes(dest), None if base is None else as_bytes(base), dest.dtype)
        try:
            self.t.post_send(nxt, key, send)
        except BaseException:
            self.t.unpost(posted)
            raise
        self.t.collect(posted, self.what(), self.deadline)


def _start(
    t: Messenger, kind: str, tag: str, group: Group, meta: tuple[int, ...], a: np.ndarray | None
) -> _Call:
    pos = t.check_members(kind, tag, group)
    desc = {
        "kind": kind,
        "tag": tag,
        "group": list(group),
        "meta": list(meta),
        "d": None if a is None else encode_dtype(a.dtype),
        "s": None if a is None else list(a.shape),
    }
    return _Call(t, desc, group, pos, t.next_seq(tuple(sorted(group))), time.monotonic() + t.timeout)


def _axis(t: Messenger, a: np.ndarray, axis: int, tag: str) -> int:
    if not -a.ndim <= axis < a.ndim:
        raise TransportError(
            f"rank {t.rank}: tag {tag!r}: axis {axis} is out of range for an array of shape {a.shape}"
        )
    return axis % a.ndim


def _sum_in_order(t: Messenger, arrays: list[np.ndarray], like: np.ndarray) -> np.ndarray:
    out = t.pool.empty(like.shape, like.dtype)
    if len(arrays) == 1:
        np.copyto(out, arrays[0])
        return out
    np.add(arrays[0], arrays[1], out=out)
    for x in arrays[2:]:
        np.add(out, x, out=out)
    return out


def _pair_sum(call: _Call, mine: np.ndarray, send: np.ndarray) -> np.ndarray:
    """Two members: ``mine`` + the peer's array, with ``send`` (C-contiguous) going to the peer, in the
    one opening exchange; the peer's payload is added into the result as it arrives (see the module)."""
    t = call.t
    (peer,) = call.peers()
    key = call.key(0)
    out = t.pool.empty(mine.shape, mine.dtype)
    posted = t.post(peer, key, as_bytes(out), as_bytes(mine), mine.dtype)
    try:
        t.post_send(peer, key, send, {"c": call.desc})  # first: the peer needs it to find a mismatch too
    except BaseException:
        t.unpost(posted)
        raise
    if posted.early is not None:  # it came before the post: check the call before adding what came
        call.check(peer, posted.early.meta.get("c"))
    try:
        meta = t.collect(posted, call.what(), call.deadline)
    except TransportError:
        if posted.error is None:
            raise
        # what came does not fit (the receive thread queued it instead): say how the calls differ
        call.check(peer, t.take(peer, key, call.what(), call.deadline).meta.get("c"))
        raise
    call.check(peer, meta.get("c"))
    return out


def _ring_reduce_scatter(call: _Call, x: np.ndarray, out: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """After n - 1 steps, chunk ``pos`` of ``out`` (flat) holds the sum of every member's chunk ``pos``."""
    n, pos = len(call.group), call.pos
    for s in range(n - 1):
        sc, rc = (pos - s - 1) % n, (pos - s - 2) % n
        src = x if s == 0 else out
        call.ring_step(1 + s, src[slice(*bounds[sc])], out[slice(*bounds[rc])], x[slice(*bounds[rc])])


# -- the collectives --------------------------------------------------------------------------------


def all_reduce(t: Messenger, array: Array, group: Group, tag: str) -> np.ndarray:
    a = contiguous(array)
    call = _start(t, "all_reduce", tag, group, (), a)
    n = len(group)
    if n == 1:
        return a.copy()
    if n == 2 and a.nbytes <= DIRECT_BYTES:
        return _pair_sum(call, a, a)
    if a.nbytes * (n - 1) <= DIRECT_BYTES:
        got = call.exchange(lambda peer: a)
        return _sum_in_order(t, [a if r == t.rank else got[r] for r in group], a)
    call.exchange(None)
    x, out = a.reshape(-1), t.pool.empty(a.size, a.dtype)
    bounds = [split_range(a.size, n, c) for c in range(n)]
    _ring_reduce_scatter(call, x, out, bounds)
    pos = call.pos
    for s in range(n - 1):
        sc, rc = (pos - s) % n, (pos - s - 1) % n
        call.ring_step(n + s, out[slice(*bounds[sc])], out[slice(*bounds[rc])], None)
    return out.reshape(a.shape)


def reduce_scatter(t: Messenger, array: Array, group: Group, axis: int, tag: str) -> np.ndarray:
    a = contiguous(array)
    axis = _axis(t, a, axis, tag)
    call = _start(t, "reduce_scatter", tag, group, (axis,), a)
    n = len(group)
    if n == 1:
        return a.copy()
    if n == 2 and a.nbytes <= DIRECT_BYTES:
        theirs = part(a, axis, n, 1 - call.pos)
        return _pair_sum(call, np.ascontiguousarray(part(a, axis, n, call.pos)), np.ascontiguousarray(theirs))
    if a.nbytes * (n - 1) <= DIRECT_BYTES:
        got = call.exchange(lambda peer: np.ascontiguousarray(part(a, axis, n, group.index(peer))))
        mine = part(a, axis, n, call.pos)
        return _sum_in_order(t, [mine if r == t.rank else got[r] for r in group], mine)
    call.exchange(None)
    moved = np.ascontiguousarray(np.moveaxis(a, axis, 0))
    inner = moved[0].size if moved.shape[0] else 0
    bounds = [(lo * inner, hi * inner) for lo, hi in (split_range(moved.shape[0], n, c) for c in range(n))]
    x, out = moved.reshape(-1), t.pool.empty(moved.size, a.dtype)  # scratch: back to the pool at return
    _ring_reduce_scatter(call, x, out, bounds)
    lo, hi = bounds[call.pos]
    mine = out[lo:hi].reshape((-1,) + moved.shape[1:]) if inner else np.empty((0,) + moved.shape[1:], a.dtype)
    moved_back = np.moveaxis(mine, 0, axis)
    result = t.pool.empty(moved_back.shape, a.dtype)
    np.copyto(result, moved_back)
    return result


def all_gather(t: Messenger, array: Array, group: Group, axis: int, tag: str) -> np.ndarray:
    a = contiguous(array)
    axis = _axis(t, a, axis, tag)
    call = _start(t, "all_gather", tag, group, (axis,), a)
    got = call.exchange(lambda peer: a)
    parts = [a if r == t.rank else got[r] for r in group]
    shape = list(a.shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    return np.concatenate(parts, axis=axis, out=t.pool.empty(tuple(shape), a.dtype))


def all_to_all(
    t: Messenger, array: Array, group: Group, split_axis: int, concat_axis: int, tag: str
) -> np.ndarray:
    a = contiguous(array)
    meta = (_axis(t, a, split_axis, tag), _axis(t, a, concat_axis, tag))
    call = _start(t, "all_to_all", tag, group, meta, a)
    n = len(group)
    got = call.exchange(lambda peer: np.ascontiguousarray(part(a, meta[0], n, group.index(peer))))
    parts = [part(a, meta[0], n, call.pos) if r == t.rank else got[r] for r in group]
    return np.concatenate(parts, axis=meta[1])


def broadcast(t: Messenger, array: Array | None, root: int, group: Group, tag: str) -> np.ndarray:
    group = check_broadcast(t.rank, array, root, group, tag)
    a = contiguous(array) if root == t.rank else None  # type: ignore[arg-type]
    call = _start(t, "broadcast", tag, group, (root,), a)
    if a is not None:
        for peer in call.peers():
            t.post_send(peer, call.key(0), a, {"c": call.desc})
        return a.copy()
    message = t.take(root, call.key(0), call.what(), call.deadline)
    call.check(root, message.meta.get("c"))
    return message.array
