"""The in-process transport: ranks are threads of one process, the test vehicle and the embedded mode.

Collectives meet in a per-group rendezvous: the k-th collective call of each member joins round k of
its group. A round has two barriers. At the first every member has put in its array (and, for
all-reduce, its empty output), so each member can compute its own share of the result from the others'
inputs with numpy, which releases the GIL, so members work in parallel. At the second every member
has finished reading the others' inputs, so a caller may reuse its input the moment it returns.

All-reduce is a reduce-scatter and all-gather over shared memory: member p sums chunk p of the flat
arrays in group order (one sum per element, the same on every member, so results are bit-identical)
and writes the chunk into every member's output. Point-to-point messages are copied on send into
FIFO mailboxes keyed by (src, dst, tag); a send never blocks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sbpflow.actor_workers.transport.base import (
    Array,
    Group,
    TransportAborted,
    TransportError,
    check_broadcast,
    check_movable,
    part,
)
from sbpflow.sharding import split_range

# -- the collectives: how members must agree, and what member ``pos`` computes ----------------------


@dataclass(slots=True)
class _Call:
    """One member's side of a collective."""

    rank: int
    kind: str
    tag: str
    group: Group
    meta: tuple[int, ...]  # axis / (split_axis, concat_axis) / root, as the caller gave them
    array: Array | None
    out: Array | None = None  # all-reduce: the caller's output, written by every member

    def describe(self) -> str:
        names = _OPS[self.kind].meta_names
        args = "".join(f", {n}={v}" for n, v in zip(names, self.meta, strict=True))
        shape = "no array" if self.array is None else f"{self.array.dtype}{list(self.array.shape)}"
        return f"{self.kind}(tag={self.tag!r}, group={self.group}{args}, {shape})"


def _all_reduce(pos: int, calls: list[_Call]) -> Array:
    flats = [c.array.reshape(-1) for c in calls]  # type: ignore[union-attr]
    lo, hi = split_range(flats[0].size, len(calls), pos)
    own = calls[pos].out.reshape(-1)[lo:hi]  # type: ignore[union-attr]
    if len(flats) == 1:
        own[...] = flats[0][lo:hi]
    else:
        np.add(flats[0][lo:hi], flats[1][lo:hi], out=own)
        for f in flats[2:]:
            np.add(own, f[lo:hi], out=own)
    for i, c in enumerate(calls):
        if i != pos:
            c.out.reshape(-1)[lo:hi] = own  # type: ignore[union-attr]
    return calls[pos].out


def _reduce_scatter(pos: int, calls: list[_Call]) -> Array:
    (axis,) = calls[pos].meta
    parts = [part(c.array, axis, len(calls), pos) for c in calls]
    if len(parts) == 1:
        return parts[0].copy()
    out = np.add(parts[0], parts[1])
    for p in parts[2:]:
        np.add(out, p, out=out)
    return out


def _all_gather(pos: int, calls: list[_Call]) -> Array:
    (axis,) = calls[pos].meta
    return np.concatenate([c.array for c in calls], axis=axis)


def _all_to_all(pos: int, calls: list[_Call]) -> Array:
    split_axis, concat_axis = calls[pos].meta
    n = len(calls)
    return np.concatenate([part(c.array, split_axis, n, pos) for c in calls], axis=concat_axis)


def _broadcast(pos: int, calls: list[_Call]) -> Array:
    (root,) = calls[pos].meta
    src = calls[calls[pos].group.index(root)].array
    return np.array(src, copy=True)


def _equal_shapes(a: _Call, b: _Call) -> bool:
    assert a.array is not None and b.array is not None
    return a.array.dtype == b.array.dtype and a.array.shape == b.array.shape


def _equal_but(meta_index: int) -> Callable[[_Call, _Call], bool]:
    """Shapes agree except along the axis ``meta[meta_index]``, where members' sizes may differ."""

    def agree(a: _Call, b: _Call) -> bool:
        assert a.array is not None and b.array is not None
        free = a.meta[meta_index]
        x, y = a.array, b.array
        return (
            x.dtype == y.dtype
            and x.ndim == y.ndim
            and all(p == q for i, (p, q) in enumerate(zip(x.shape, y.shape, strict=True)) if i != free)
        )

    return agree


@dataclass(frozen=True)
class _Op:
    meta_names: tuple[str, ...]
    work: Callable[[int, list[_Call]], Array]  # what member ``pos`` computes once everyone is in
    agree: Callable[[_Call, _Call], bool]  # do two members' arrays fit together


_OPS: dict[str, _Op] = {
    "all_reduce": _Op((), _all_reduce, _equal_shapes),
    "reduce_scatter": _Op(("axis",), _reduce_scatter, _equal_shapes),
    "all_gather": _Op(("axis",), _all_gather, _equal_but(0)),
    "all_to_all": _Op(("split_axis", "concat_axis"), _all_to_all, _equal_but(1)),
    "broadcast": _Op(("root",), _broadcast, lambda a, b: True),  # only the root's array counts
}


def _disagree(a: _Call, b: _Call) -> bool:
    same_call = (a.kind, a.tag, a.group, a.meta) == (b.kind, b.tag, b.group, b.meta)
    return not (same_call and _OPS[a.kind].agree(a, b))


# -- the rendezvous ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Round:
    """Round ``seq`` of one group: the seq-th collective of every member."""

    size: int
    calls: dict[int, _Call] = field(default_factory=dict)
    first: _Call | None = None
    done: set[int] = field(default_factory=set)
    left: int = 0
    error: str | None = None  # set once; every member still in (or yet to come) raises it


class _Rendezvous:
    """One group's meeting point (a group is its set of ranks; the order is part of each call)."""

    def __init__(self, world: InProcessWorld, members: Group) -> None:
        self.world = world
        self.members = members
        self.cond = threading.Condition()
        self.next_seq = dict.fromkeys(members, 0)
        self.rounds: dict[int, _Round] = {}

    def run(self, call: _Call, pos: int) -> Array:
        deadline = time.monotonic() + self.world.timeout
        n = len(call.group)
        with self.cond:
            seq = self.next_seq[call.rank]
            self.next_seq[call.rank] = seq + 1
            rnd = self.rounds.get(seq)
            if rnd is None:
                rnd = self.rounds[seq] = _Round(n)
            self._join(rnd, call, seq)
            try:
                self._wait(rnd, lambda: len(rnd.calls) == n, call, seq, deadline, "reach")
            except TransportError:
                self._leave(rnd, seq)
                raise
            calls = [rnd.calls[r] for r in call.group]
        try:
            result = _OPS[call.kind].work(pos, calls)
        except Exception as e:
            with self.cond:
                rnd.error = rnd.error or f"rank {call.rank}: {call.describe()} failed: {e!r}"
                self.cond.notify_all()
                self._leave(rnd, seq)
            raise TransportError(f"rank {call.rank}: {call.describe()} failed: {e!r}") from e
        with self.cond:
            rnd.done.add(call.rank)
            if len(rnd.done) == n:
                self.cond.notify_all()
            try:
                self._wait(rnd, lambda: len(rnd.done) == n, call, seq, deadline, "finish")
            finally:
                self._leave(rnd, seq)
        return result

    def _join(self, rnd: _Round, call: _Call, seq: int) -> None:
        rnd.calls[call.rank] = call
        if rnd.first is None:
            rnd.first = call
        elif rnd.error is None and _disagree(rnd.first, call):
            rnd.error = (
                f"collective #{seq} of group {self.members} does not match: rank {rnd.first.rank} called "
                f"{rnd.first.describe()} but rank {call.rank} called {call.describe()}; every member must "
                "issue the same collectives on a group in the same order (the plan's communicator order), "
                "with the same tag, group order and agreeing shapes"
            )
        if len(rnd.calls) == rnd.size or rnd.error is not None:
            self.cond.notify_all()

    def _wait(
        self, rnd: _Round, ready: Callable[[], bool], call: _Call, seq: int, deadline: float, what: str
    ) -> None:
        """Wait (holding ``cond``) until ``ready()``; raise on abort, a failed round or the deadline."""
        while True:
            reason = self.world.abort_reason
            if reason is not None:
                raise TransportAborted(reason)
            if rnd.error is not None:
                raise TransportError(rnd.error)
            if ready():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                present = rnd.calls if what == "reach" else rnd.done
                missing = [r for r in call.group if r not in present]
                rnd.error = (
                    f"rank {call.rank} gave up on {call.describe()} (collective #{seq} of group "
                    f"{self.members}) after {self.world.timeout:g} s: rank(s) {missing} did not {what} it"
                )
                self.cond.notify_all()
                raise TransportError(
                    f"{rnd.error}. A peer that never issues this collective, or issues the group's "
                    "collectives in another order, hangs it: check the communicator order, or give "
                    "InProcessWorld a longer timeout"
                )
            self.cond.wait(remaining)

    def _leave(self, rnd: _Round, seq: int) -> None:
        rnd.left += 1
        if rnd.left == rnd.size:
            del self.rounds[seq]


# -- mailboxes --------------------------------------------------------------------------------------


class _Mailbox:
    """Every message waiting for one destination rank, FIFO per (src, tag)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queues: dict[tuple[int, str], deque[Array]] = {}

    def pending(self) -> str:
        return ", ".join(f"from rank {s} tag {t!r} ({len(q)})" for (s, t), q in self.queues.items()) or "none"


# -- the world and one rank's transport -------------------------------------------------------------


class InProcessWorld:
    """The ranks of one in-process job; ``transport(rank)`` is the handle one rank-thread uses."""

    def __init__(self, ranks: Sequence[int], timeout: float = 60.0) -> None:
        ranks = tuple(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks):
            raise TransportError(f"InProcessWorld needs distinct ranks, got {list(ranks)}")
        if timeout <= 0:
            raise TransportError(f"InProcessWorld timeout must be positive, got {timeout}")
        self.ranks = ranks
        self.timeout = float(timeout)
        self.abort_reason: str | None = None
        self._lock = threading.Lock()
        self._groups: dict[Group, _Rendezvous] = {}
        self._mailboxes = {r: _Mailbox() for r in ranks}
        self._transports = {r: InProcessTransport(self, r) for r in ranks}

    def transport(self, rank: int) -> InProcessTransport:
        try:
            return self._transports[rank]
        except KeyError:
            raise TransportError(f"rank {rank} is not in this world (ranks {list(self.ranks)})") from None

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.abort_reason is None:
                self.abort_reason = reason
            conds = [g.cond for g in self._groups.values()] + [m.cond for m in self._mailboxes.values()]
        for c in conds:
            with c:
                c.notify_all()

    def close(self) -> None:
        for t in self._transports.values():
            t.close()

    def __enter__(self) -> InProcessWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rendezvous(self, members: Group) -> _Rendezvous:
        g = self._groups.get(members)
        if g is None:
            with self._lock:
                g = self._groups.setdefault(members, _Rendezvous(self, members))
        return g


class InProcessTransport:
    """One rank's :class:`~sbpflow.actor_workers.transport.base.Transport` in an :class:`InProcessWorld`."""

    def __init__(self, world: InProcessWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self._closed = False
        self._groups: dict[Group, tuple[_Rendezvous, int]] = {}  # checked groups: (rendezvous, my pos)

    # point to point

    def send(self, array: Array, dst: int, tag: str) -> None:
        self._check_open()
        box = self.world._mailboxes.get(dst)
        if box is None:
            raise TransportError(
                f"rank {self.rank}: send tag {tag!r} to rank {dst}, which is not in this world "
                f"(ranks {list(self.world.ranks)})"
            )
        copy = np.array(array, copy=True)
        check_movable(self.rank, copy, f"send tag {tag!r} to rank {dst}")
        with box.cond:
            box.queues.setdefault((self.rank, tag), deque()).append(copy)
            box.cond.notify_all()

    def recv(self, src: int, tag: str) -> Array:
        self._check_open()
        if src not in self.world._mailboxes:
            raise TransportError(
                f"rank {self.rank}: recv tag {tag!r} from rank {src}, which is not in this world "
                f"(ranks {list(self.world.ranks)})"
            )
        box = self.world._mailboxes[self.rank]
        key = (src, tag)
        deadline = time.monotonic() + self.world.timeout
        with box.cond:
            while True:
                reason = self.world.abort_reason
                if reason is not None:
                    raise TransportAborted(reason)
                q = box.queues.get(key)
                if q:
                    value = q.popleft()
                    if not q:
                        del box.queues[key]
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(
                        f"rank {self.rank} waited {self.world.timeout:g} s in recv from rank {src} tag "
                        f"{tag!r} and nothing arrived (waiting for rank {self.rank}: {box.pending()}); "
                        "the sender never sent it, or sent it under another tag"
                    )
                box.cond.wait(remaining)

    # collectives

    def all_reduce(self, array: Array, group: Group, tag: str) -> Array:
        a = np.asarray(array, order="C")  # not ascontiguousarray: it makes 0-d 1-d
        call = _Call(self.rank, "all_reduce", tag, tuple(group), (), a, np.empty(a.shape, a.dtype))
        return self._collective(call)

    def reduce_scatter(self, array: Array, group: Group, axis: int, tag: str) -> Array:
        a = np.asarray(array)
        return self._collective(
            _Call(self.rank, "reduce_scatter", tag, tuple(group), (self._axis(a, axis, tag),), a)
        )

    def all_gather(self, array: Array, group: Group, axis: int, tag: str) -> Array:
        a = np.asarray(array)
        return self._collective(
            _Call(self.rank, "all_gather", tag, tuple(group), (self._axis(a, axis, tag),), a)
        )

    def all_to_all(self, array: Array, group: Group, split_axis: int, concat_axis: int, tag: str) -> Array:
        a = np.asarray(array)
        meta = (self._axis(a, split_axis, tag), self._axis(a, concat_axis, tag))
        return self._collective(_Call(self.rank, "all_to_all", tag, tuple(group), meta, a))

    def broadcast(self, array: Array | None, root: int, group: Group, tag: str) -> Array:
        group = check_broadcast(self.rank, array, root, group, tag)
        a = np.asarray(array) if root == self.rank else None
        return self._collective(_Call(self.rank, "broadcast", tag, group, (root,), a))

    # lifecycle

    def abort(self, reason: str) -> None:
        self.world.abort(reason)

    def close(self) -> None:
        self._closed = True

    # helpers

    def _collective(self, call: _Call) -> Array:
        self._check_open()
        if call.array is not None:
            check_movable(self.rank, call.array, f"{call.kind} tag {call.tag!r}")
        found = self._groups.get(call.group)
        if found is None:
            found = self._groups[call.group] = self._check_group(call)
        rendezvous, pos = found
        return rendezvous.run(call, pos)

    def _check_group(self, call: _Call) -> tuple[_Rendezvous, int]:
        group = call.group
        problem = None
        if len(set(group)) != len(group):
            problem = "has repeated ranks"
        elif not set(group) <= set(self.world.ranks):
            problem = f"has ranks outside the world {list(self.world.ranks)}"
        elif self.rank not in group:
            problem = f"does not contain the calling rank {self.rank}"
        if problem is not None:
            raise TransportError(f"rank {self.rank}: {call.kind} tag {call.tag!r}: group {group} {problem}")
        return self.world._rendezvous(tuple(sorted(group))), group.index(self.rank)

    def _axis(self, a: Array, axis: int, tag: str) -> int:
        if not -a.ndim <= axis < a.ndim:
            raise TransportError(
                f"rank {self.rank}: tag {tag!r}: axis {axis} is out of range for an array of shape {a.shape}"
            )
        return axis % a.ndim

    def _check_open(self) -> None:
        reason = self.world.abort_reason
        if reason is not None:
            raise TransportAborted(reason)
        if self._closed:
            raise TransportError(f"rank {self.rank}: the transport is closed")
