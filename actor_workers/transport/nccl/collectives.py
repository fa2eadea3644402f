"""The NCCL transport's collectives: one function per op, run on a communicator after the header round.

Each takes a :class:`Call` (this rank's array, the op's axes, every member's header) and enqueues its
NCCL call on the communicator's stream, which is current while it runs (``NcclComms.run`` orders it
after its inputs and hands its result over); none waits for the data. :data:`RUN`
maps each op of the wire format (``nccl_wire.OPS``) but ``send`` to its function.

**Uneven splits** (``split_range``): reduce-scatter and all-gather pad every part to the largest one
(parts differ by at most one row) and keep NCCL's ring algorithms; all-to-all is grouped send/recv
(``groupStart``/``groupEnd``), which takes parts of any size without padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sbpflow.actor_workers.transport.base import part
from sbpflow.actor_workers.transport.nccl.comms import Comm, NcclComms
from sbpflow.actor_workers.transport.nccl.headers import Header, nccl_type
from sbpflow.sharding import split_range


@dataclass
class Call:
    """One collective call on this rank, after the header round: what an op's run function needs."""

    t: NcclComms
    comm: Comm
    array: Any  # cupy array, or None (broadcast, not the root)
    meta: tuple[int, ...]
    headers: list[Header]
    kept: list[Any] = field(default_factory=list)  # arrays the NCCL calls read or write, kept until done

    @property
    def size(self) -> int:
        return len(self.headers)

    @property
    def pos(self) -> int:
        return self.comm.pos

    def launch(self, count: int, keep: tuple[Any, ...], enqueue: Callable[[Any, int], None]) -> None:
        """Enqueue one NCCL call moving ``count`` elements on the communicator's stream; none for an empty
        array (members agree on ``count``: the header round, or the first one, checked their shapes)."""
        if count:
            self.kept.extend(keep)
            enqueue(self.comm.handle, self.comm.stream.ptr)


def _contiguous(a: Any) -> Any:
    return a if a.flags.c_contiguous else a.copy()


def _rows(cp: Any, a: Any, axis: int) -> Any:
    """``a`` with ``axis`` moved first, C-contiguous: the layout the ring collectives cut."""
    return _contiguous(cp.moveaxis(a, axis, 0))


def _all_reduce(c: Call) -> Any:
    cp, x = c.t.cp, _contiguous(c.array)
    out = cp.empty_like(x)
    kind = nccl_type(x.dtype)
    c.launch(
        x.size,
        (x, out),
        lambda h, s: h.allReduce(x.data.ptr, out.data.ptr, x.size, kind.code, kind.reduce, s),
    )
    return out


def _reduce_scatter(c: Call) -> Any:
    cp, (axis,), p = c.t.cp, c.meta, c.size
    rows = _rows(cp, c.array, axis)
    n, rest = rows.shape[0], rows.shape[1:]
    spans = [split_range(n, p, j) for j in range(p)]
    m = max(hi - lo for lo, hi in spans)
    if n == m * p:
        send = rows
    else:  # pad every part to m rows
        send = cp.zeros((p, m, *rest), rows.dtype)
        for j, (lo, hi) in enumerate(spans):
            send[j, : hi - lo] = rows[lo:hi]
    recv = cp.empty((m, *rest), rows.dtype)
    kind = nccl_type(rows.dtype)
    count = recv.size
    c.launch(
        count,
        (send, recv),
        lambda h, s: h.reduceScatter(send.data.ptr, recv.data.ptr, count, kind.code, kind.reduce, s),
    )
    lo, hi = spans[c.pos]
    return cp.ascontiguousarray(cp.moveaxis(recv[: hi - lo], 0, axis))


def _all_gather(c: Call) -> Any:
    cp, (axis,) = c.t.cp, c.meta
    rows = _rows(cp, c.array, axis)
    sizes = [h.shape[axis] for h in c.headers]  # type: ignore[index]
    m, rest = max(sizes), rows.shape[1:]
    send = rows
    if rows.shape[0] != m:
        send = cp.zeros((m, *rest), rows.dtype)
        send[: rows.shape[0]] = rows
    recv = cp.empty((c.size, m, *rest), rows.dtype)
    kind, count = nccl_type(rows.dtype), send.size
    c.launch(count, (send, recv), lambda h, s: h.allGather(send.data.ptr, recv.data.ptr, count, kind.code, s))
    if all(n == m for n in sizes):
        gathered = recv.reshape(c.size * m, *rest)
    else:
        gathered = cp.concatenate([recv[j, :n] for j, n in enumerate(sizes)], axis=0)
    return cp.ascontiguousarray(cp.moveaxis(gathered, 0, axis))


def _all_to_all(c: Call) -> Any:
    cp, (split_axis, concat_axis), p, me = c.t.cp, c.meta, c.size, c.pos
    sends = [_contiguous(part(c.array, split_axis, p, j)) for j in range(p)]
    recvs = []
    for i, h in enumerate(c.headers):
        assert h.shape is not None
        shape = list(h.shape)
        lo, hi = split_range(shape[split_axis], p, me)
        shape[split_axis] = hi - lo
        recvs.append(sends[me] if i == me else cp.empty(tuple(shape), c.array.dtype))
    kind = nccl_type(c.array.dtype)

    def launch(h: Any, s: int) -> None:
        nccl = c.t.nccl
        nccl.groupStart()
        try:
            for j in range(p):
                if j != me and sends[j].size:
                    h.send(sends[j].data.ptr, sends[j].size, kind.code, j, s)
                if j != me and recvs[j].size:
                    h.recv(recvs[j].data.ptr, recvs[j].size, kind.code, j, s)
        finally:
            nccl.groupEnd()

    c.kept.extend((*sends, *recvs))
    launch(c.comm.handle, c.comm.stream.ptr)
    return cp.concatenate(recvs, axis=concat_axis)


def _broadcast(c: Call) -> Any:
    cp, (root_pos,) = c.t.cp, c.meta
    h0 = c.headers[root_pos]
    assert h0.shape is not None and h0.dtype is not None
    out = cp.empty(h0.shape, h0.dtype)
    send = _contiguous(c.array) if c.pos == root_pos else out
    kind = nccl_type(out.dtype)
    c.launch(
        out.size,
        (send, out),
        lambda h, s: h.broadcast(send.data.ptr, out.data.ptr, out.size, kind.code, root_pos, s),
    )
    return out


RUN: dict[str, Callable[[Call], Any]] = {
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
    "broadcast": _broadcast,
}
