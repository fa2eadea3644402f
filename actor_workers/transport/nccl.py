"""The NCCL transport: the data plane between GPU workers, on cupy arrays through ``cupy.cuda.nccl``.

One :class:`NcclTransport` per rank (one process or thread per GPU). Rules and design choices:

- **Bootstrap.** Rank 0 calls :meth:`NcclTransport.unique_id` and the control plane ships the 128 bytes to
  every rank: that id makes the world communicator (``ranks`` in the given order; NCCL rank = position).
  ncclCommSplit is not in cupy, so every other communicator is made from its own id, asked of
  ``uid_for(key)`` with a :class:`CommKey` (``collective:0,2`` for a group in call order, ``p2p:0->2`` for
  the messages from rank 0 to rank 2). ``uid_for`` must return the same id to every member of ``key``:
  the control plane implements it as get-or-create in its key-value store (the first member to ask makes
  the id with ``unique_id()``); :class:`SharedUids` is that for ranks in one process (threads, tests).
  Communicators are made lazily, on a key's first call, and creation waits at most ``timeout``.
- **Streams.** Each communicator has its own CUDA stream. Work is ordered with events: the comm stream
  waits for an event recorded on the caller's current stream (the inputs are ready), runs the NCCL call,
  and the caller's stream waits for an event recorded after it (the result is ready). The host does not
  wait for the data, so compute and communication overlap. One stream per communicator, not one for
  all: the plan orders the calls of each communicator, not the calls of different ones, and a shared
  stream would serialise two groups in an order their other members need not follow (a hang).
- **Headers.** Every collective first all-gathers a small int64 header per member (op, tag, axes, dtype,
  shape, call number): members that disagree get a :class:`TransportError` naming both sides instead of
  garbage or a hang, and all-gather / all-to-all / broadcast learn the other members' shapes. The host
  waits for the header (with ``timeout``), never for the payload.
- **Uneven splits** (``split_range``): reduce-scatter and all-gather pad every part to the largest one
  (parts differ by at most one row) and keep NCCL's ring algorithms; all-to-all is grouped send/recv
  (``groupStart``/``groupEnd``), which takes parts of any size without padding.
- **Send/recv.** A message is a header then its payload on the ``p2p:src->dst`` communicator, one per
  direction, so a send from a to b never waits behind a recv from b. ``send`` copies the array and
  returns at once (making a communicator is a rendezvous the peer joins at its first recv, so a send to a
  peer with none yet queues, and a thread makes it and sends the queue in order); ``recv`` waits for the header, keeps messages of other tags aside (FIFO per
  (src, tag), as the contract says), and returns without waiting for the payload. A rank sending to
  itself goes through a local mailbox (NCCL has no one-member pair).
- **Abort.** ``abort(reason)`` aborts every communicator of this rank (ncclCommAbort ends its kernels),
  makes every blocked and later call raise ``TransportAborted(reason)`` and calls ``on_abort(reason)``
  once: the control plane's hook that aborts the other ranks. A timeout aborts too (a hung NCCL call
  never returns). Inputs stay referenced until their NCCL call is done, so freeing them is safe.
- Without cupy, importing this module works; constructing a transport raises the install hint.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport.base import Group, TransportAborted, TransportError, part
from sbpflow.device import INSTALL_HINT
from sbpflow.dtype import DType
from sbpflow.sharding import split_range

UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES

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
NOT_MOVABLE: dict[DType, str] = {
    DType.bfloat16: "cupy has no bfloat16 arrays, so no bfloat16 register ever reaches the transport",
}


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


def _nccl() -> Any:
    """``cupy.cuda.nccl``, or a TransportError with the install hint."""
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl
    except Exception as e:
        raise TransportError(
            f"the NCCL transport needs cupy with NCCL, which cannot be imported ({e!r}); {INSTALL_HINT}"
        ) from e
    if not getattr(nccl, "available", False):
        raise TransportError(
            f"cupy is installed but was built without NCCL (cupy.cuda.nccl.available is False); {INSTALL_HINT}"
        )
    return nccl


@dataclass(frozen=True, slots=True)
class CommKey:
    """Names one communicator: ``kind`` "collective" (``ranks``: the group in call order) or "p2p"
    (``ranks``: (src, dst)). ``str(key)`` is the stable name a control plane files its unique id under."""

    kind: str
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        if self.kind == "p2p":
            return f"p2p:{self.ranks[0]}->{self.ranks[1]}"
        return f"collective:{','.join(map(str, self.ranks))}"


UidFor = Callable[[CommKey], bytes]


class SharedUids:
    """``uid_for`` for ranks in one process: the first member to ask for a key makes its id."""

    def __init__(self, make: Callable[[], bytes] | None = None) -> None:
        self._make = make or NcclTransport.unique_id
        self._lock = threading.Lock()
        self._ids: dict[CommKey, bytes] = {}

    def __call__(self, key: CommKey) -> bytes:
        with self._lock:
            if key not in self._ids:
                self._ids[key] = self._make()
            return self._ids[key]


@dataclass(eq=False)
class _Comm:
    """One communicator of this rank: the NCCL handle, its stream, this rank's position, work in flight."""

    key: CommKey
    handle: Any  # cupy.cuda.nccl.NcclCommunicator
    stream: Any  # cupy.cuda.Stream
    pos: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    inflight: deque[tuple[Any, tuple[Any, ...]]] = field(default_factory=deque)  # (done event, kept arrays)


@dataclass
class _Call:
    """One collective call on this rank, after the header round: what an op's run function needs."""

    t: NcclTransport
    comm: _Comm
    array: Any  # cupy array, or None (broadcast, not the root)
    meta: tuple[int, ...]
    headers: list[Header]

    @property
    def size(self) -> int:
        return len(self.headers)

    @property
    def pos(self) -> int:
        return self.comm.pos

    def launch(self, count: int, keep: tuple[Any, ...], enqueue: Callable[[Any, int], None]) -> None:
        """Enqueue one NCCL call moving ``count`` elements; none for an empty array (members agree on
        ``count``: the header round checked their shapes)."""
        if count:
            self.t.launch(self.comm, keep, enqueue)


def _contiguous(a: Any) -> Any:
    return a if a.flags.c_contiguous else a.copy()


def _rows(cp: Any, a: Any, axis: int) -> Any:
    """``a`` with ``axis`` moved first, C-contiguous: the layout the ring collectives cut."""
    return _contiguous(cp.moveaxis(a, axis, 0))


def _all_reduce(c: _Call) -> Any:
    cp, x = c.t.cp, _contiguous(c.array)
    out = cp.empty_like(x)
    kind = nccl_type(x.dtype)
    c.launch(
        x.size,
        (x, out),
        lambda h, s: h.allReduce(x.data.ptr, out.data.ptr, x.size, kind.code, kind.reduce, s),
    )
    return out


def _reduce_scatter(c: _Call) -> Any:
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


def _all_gather(c: _Call) -> Any:
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


def _all_to_all(c: _Call) -> Any:
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

    c.t.launch(c.comm, (*sends, *recvs), launch)
    return cp.concatenate(recvs, axis=concat_axis)


def _broadcast(c: _Call) -> Any:
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


RUN: dict[str, Callable[[_Call], Any]] = {
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
    "broadcast": _broadcast,
}


class NcclTransport:
    """One rank's :class:`~sbpflow.actor_workers.transport.base.Transport` over NCCL (see the module doc).

    ``rank`` is this rank's global rank, ``ranks`` the world in NCCL order, ``uid`` the world's unique id
    (rank 0's :meth:`unique_id`), ``device`` the CUDA device (default: the current one), ``uid_for`` the
    id of every other communicator, ``timeout`` the longest wait (seconds) of any call, ``on_abort`` the
    hook that carries an abort to the other ranks. Arrays in and out are cupy arrays on ``device``
    (numpy inputs are copied there).
    """

    def __init__(
        self,
        rank: int,
        ranks: Sequence[int],
        uid: bytes,
        device: int | None = None,
        uid_for: UidFor | None = None,
        timeout: float = 300.0,
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        world = tuple(int(r) for r in ranks)
        if not world or len(set(world)) != len(world):
            raise TransportError(f"NcclTransport needs distinct ranks, got {list(ranks)}")
        if rank not in world:
            raise TransportError(f"NcclTransport: rank {rank} is not in ranks {list(world)}")
        if not isinstance(uid, bytes | bytearray) or len(uid) != UID_BYTES:
            got = f"{len(uid)} bytes" if isinstance(uid, bytes | bytearray) else type(uid).__name__
            raise TransportError(
                f"NcclTransport: uid must be the {UID_BYTES} bytes of NcclTransport.unique_id() made on rank "
                f"{world[0]} and shipped to every rank, got {got}"
            )
        if timeout <= 0:
            raise TransportError(f"NcclTransport timeout must be positive, got {timeout}")
        self.nccl = _nccl()
        import cupy

        self.cp: Any = cupy
        self.rank, self.world, self.uid = rank, world, bytes(uid)
        self.device = int(cupy.cuda.Device().id if device is None else device)
        self.uid_for, self.timeout, self.on_abort = uid_for, float(timeout), on_abort
        self.abort_reason: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._making: dict[CommKey, threading.Lock] = {}
        self._comms: dict[CommKey, _Comm] = {}
        # (src, tag hash) -> messages that arrived while a recv waited for another tag
        self._stash: dict[tuple[int, int], deque[Any]] = {}
        # p2p key -> (ready event, tag, array) sends queued while a thread makes the communicator
        self._outbox: dict[CommKey, deque[tuple[Any, str, Any]]] = {}
        self._makers: list[threading.Thread] = []
        self._self_box: dict[str, deque[Any]] = {}  # messages this rank sent to itself
        self._self_cond = threading.Condition()

    @staticmethod
    def unique_id() -> bytes:
        """A fresh NCCL unique id as 128 bytes (what the control plane ships to the other ranks)."""
        return bytes(b & 0xFF for b in _nccl().get_unique_id())

    # -- point to point -------------------------------------------------------------------------------

    def send(self, array: Any, dst: int, tag: str) -> None:
        self._check_open()
        self._check_peer(dst, "send to", tag)
        with self.cp.cuda.Device(self.device):
            x = self.cp.array(array, copy=True, order="C")  # the caller may reuse its array at once
            if dst == self.rank:
                with self._self_cond:
                    self._self_box.setdefault(tag, deque()).append(x)
                    self._self_cond.notify_all()
                return
            key = CommKey("p2p", (self.rank, dst))
            with self._lock:
                comm = None if key in self._outbox else self._comms.get(key)
                if comm is None:  # not made yet: queue the message; a thread makes the communicator
                    ready = self.cp.cuda.Event(disable_timing=True)
                    ready.record(self.cp.cuda.get_current_stream())
                    if key not in self._outbox:
                        self._outbox[key] = deque()
                        maker = threading.Thread(target=self._flush_outbox, args=(key,), daemon=True)
                        self._makers.append(maker)
                        maker.start()
                    self._outbox[key].append((ready, tag, x))
                    return
            with comm.lock:
                self._send_on(comm, tag, x, None)

    def _send_on(self, comm: _Comm, tag: str, x: Any, ready: Any) -> None:
        """A header, then the payload, to the peer of a p2p communicator (after ``ready``, if given)."""
        comm.calls += 1
        head = self.cp.asarray(encode("send", tag, (), x.dtype, x.shape, comm.calls))
        kind, code = nccl_type(x.dtype), NCCL_TYPES[np.dtype(np.int64)].code

        def launch(h: Any, s: int) -> None:
            h.send(head.data.ptr, HEADER_WORDS, code, 1, s)
            if x.size:
                h.send(x.data.ptr, x.size, kind.code, 1, s)

        self.launch(comm, (head, x), launch, ready=ready, wait=False)

    def _flush_outbox(self, key: CommKey) -> None:
        """Make a p2p communicator, then send what was queued for it, in order, until the queue is empty;
        later sends go straight to it. Runs in its own thread: the peer joins only at its first recv."""
        try:
            with self.cp.cuda.Device(self.device):
                comm = self._comm(key)
                with comm.lock:
                    while True:
                        with self._lock:
                            queue = self._outbox[key]
                            if not queue:
                                del self._outbox[key]
                                return
                            ready, tag, x = queue.popleft()
                        self._send_on(comm, tag, x, ready)
        except Exception as e:
            self.abort(f"rank {self.rank}: sending on {key} failed: {e}")

    def recv(self, src: int, tag: str) -> Any:
        self._check_open()
        self._check_peer(src, "recv from", tag)
        with self.cp.cuda.Device(self.device):
            if src == self.rank:
                return self._recv_self(tag)
            comm = self._comm(CommKey("p2p", (src, self.rank)))
            want = tag_hash(tag)
            with comm.lock:
                stash = self._stash.get((src, want))
                if stash:
                    return stash.popleft()
                while True:
                    got, x = self._next_message(comm, f"recv from rank {src} tag {tag!r}")
                    if got.tag_hash == want:
                        return x
                    self._stash.setdefault((src, got.tag_hash), deque()).append(x)

    def _next_message(self, comm: _Comm, what: str) -> tuple[Header, Any]:
        """The next message on a p2p communicator: wait for its header, then post the payload's recv."""
        comm.calls += 1
        head = self.cp.empty(HEADER_WORDS, np.int64)
        code = NCCL_TYPES[np.dtype(np.int64)].code
        done = self.launch(comm, (head,), lambda h, s: h.recv(head.data.ptr, HEADER_WORDS, code, 0, s))
        self._wait(done, comm, f"{what} (message #{comm.calls})")
        got = decode(head.get(stream=comm.stream))
        assert got.dtype is not None and got.shape is not None
        x = self.cp.empty(got.shape, got.dtype)
        if x.size:
            kind = nccl_type(x.dtype)
            self.launch(comm, (x,), lambda h, s: h.recv(x.data.ptr, x.size, kind.code, 0, s))
        return got, x

    def _recv_self(self, tag: str) -> Any:
        deadline = time.monotonic() + self.timeout
        with self._self_cond:
            while not self._self_box.get(tag):
                self._check_open()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(
                        f"rank {self.rank} waited {self.timeout:g} s in recv from itself tag {tag!r} and "
                        f"nothing arrived (waiting: {sorted(k for k, q in self._self_box.items() if q)}); the "
                        "send never happened, or used another tag"
                    )
                self._self_cond.wait(min(remaining, 0.05))
            return self._self_box[tag].popleft()

    # -- collectives ----------------------------------------------------------------------------------

    def all_reduce(self, array: Any, group: Group, tag: str) -> Any:
        return self._collective("all_reduce", array, group, (), tag)

    def reduce_scatter(self, array: Any, group: Group, axis: int, tag: str) -> Any:
        return self._collective("reduce_scatter", array, group, (axis,), tag)

    def all_gather(self, array: Any, group: Group, axis: int, tag: str) -> Any:
        return self._collective("all_gather", array, group, (axis,), tag)

    def all_to_all(self, array: Any, group: Group, split_axis: int, concat_axis: int, tag: str) -> Any:
        return self._collective("all_to_all", array, group, (split_axis, concat_axis), tag)

    def broadcast(self, array: Any | None, root: int, group: Group, tag: str) -> Any:
        group = tuple(group)
        if root not in group:
            raise TransportError(
                f"rank {self.rank}: broadcast tag {tag!r} from root {root}, not in group {group}"
            )
        if root == self.rank and array is None:
            raise TransportError(f"rank {self.rank}: broadcast tag {tag!r}: the root must pass an array")
        return self._collective(
            "broadcast", array if root == self.rank else None, group, (group.index(root),), tag
        )

    def _collective(self, op: str, array: Any | None, group: Group, meta: tuple[int, ...], tag: str) -> Any:
        self._check_open()
        group = self._check_group(op, tuple(int(r) for r in group), tag)
        with self.cp.cuda.Device(self.device):
            x = None if array is None else self.cp.asarray(array)
            if x is not None and op != "broadcast":
                meta = tuple(self._axis(x, a, tag) for a in meta)
            if x is not None:
                nccl_type(x.dtype)  # refuse a dtype NCCL cannot move before any peer waits on us
            comm = self._comm(CommKey("collective", group))
            with comm.lock:
                comm.calls += 1
                dtype, shape = (None, None) if x is None else (x.dtype, x.shape)
                mine = self.cp.asarray(encode(op, tag, meta, dtype, shape, comm.calls))
                every = self.cp.empty((len(group), HEADER_WORDS), np.int64)
                code = NCCL_TYPES[np.dtype(np.int64)].code
                done = self.launch(
                    comm,
                    (mine, every),
                    lambda h, s: h.allGather(mine.data.ptr, every.data.ptr, HEADER_WORDS, code, s),
                )
                self._wait(done, comm, f"{op} tag {tag!r} (collective #{comm.calls} of group {group})")
                headers = [decode(row) for row in every.get(stream=comm.stream)]
                check_round(headers, group)
                return RUN[op](_Call(self, comm, x, meta, headers))

    # -- lifecycle ------------------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        with self._lock:
            first = self.abort_reason is None
            if first:
                self.abort_reason = reason
            comms = list(self._comms.values())
        if not first:
            return
        for comm in comms:
            try:
                comm.handle.abort()
            except Exception:  # already destroyed or failed: nothing left to stop
                pass
        with self._self_cond:
            self._self_cond.notify_all()
        if self.on_abort is not None:
            self.on_abort(reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.timeout
        for maker in self._makers:  # queued sends go out before the communicators are torn down
            maker.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            comms, self._comms = list(self._comms.values()), {}
        with self.cp.cuda.Device(self.device):
            for comm in comms:
                if self.abort_reason is None:
                    try:
                        self._wait(self.launch(comm, (), lambda h, s: None), comm, "close (work in flight)")
                    except TransportError:
                        continue  # _wait aborted every communicator
                comm.handle.destroy()

    def __enter__(self) -> NcclTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the stream discipline ------------------------------------------------------------------------

    def launch(
        self,
        comm: _Comm,
        keep: tuple[Any, ...],
        enqueue: Callable[[Any, int], None],
        ready: Any = None,
        wait: bool = True,
    ) -> Any:
        """Run ``enqueue(handle, stream_ptr)`` on ``comm``'s stream after ``ready`` (default: the caller's
        stream's work so far), make the caller's stream wait for it (unless ``wait`` is false: nothing on
        the caller's side reads a send), and keep ``keep`` alive until it is done. Returns its event."""
        cuda = self.cp.cuda
        caller = cuda.get_current_stream()
        if ready is None:
            ready = cuda.Event(disable_timing=True)
            ready.record(caller)
        comm.stream.wait_event(ready)
        enqueue(comm.handle, comm.stream.ptr)
        done = cuda.Event(disable_timing=True)
        done.record(comm.stream)
        if wait:
            caller.wait_event(done)
        while comm.inflight and comm.inflight[0][0].done:
            comm.inflight.popleft()
        comm.inflight.append((done, keep))
        return done

    def _wait(self, event: Any, comm: _Comm, what: str) -> None:
        """Wait on the host for ``event``: raise on abort; abort everything on timeout (a hung NCCL call
        never returns, so the communicator cannot be used again)."""
        deadline, pause = time.monotonic() + self.timeout, 1e-5
        while not event.done:
            if self.abort_reason is not None:
                raise TransportAborted(self.abort_reason)
            if time.monotonic() > deadline:
                reason = (
                    f"rank {self.rank} gave up on {what} on communicator {comm.key} after {self.timeout:g} s: "
                    f"a member of {list(comm.key.ranks)} never issued it, or issued this communicator's calls "
                    "in another order; check the plan's communicator order, or give NcclTransport a longer timeout"
                )
                self.abort(reason)
                raise TransportError(reason)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    # -- communicators --------------------------------------------------------------------------------

    def _comm(self, key: CommKey) -> _Comm:
        found = self._comms.get(key)
        if found is not None:
            return found
        with self._lock:
            making = self._making.setdefault(key, threading.Lock())
        with making:  # one creation per key; other keys are not held up
            found = self._comms.get(key)
            if found is None:
                found = self._create(key)
                with self._lock:
                    self._comms[key] = found
        return found

    def _create(self, key: CommKey) -> _Comm:
        uid = self._uid(key)
        pos = key.ranks.index(self.rank)
        box: dict[str, Any] = {}

        def init() -> None:
            try:
                with self.cp.cuda.Device(self.device):
                    box["handle"] = self.nccl.NcclCommunicator(
                        len(key.ranks), tuple(b - 256 if b > 127 else b for b in uid), pos
                    )
            except Exception as e:
                box["error"] = e

        worker = threading.Thread(target=init, name=f"nccl-init-{key}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if "error" in box:
            raise TransportError(
                f"rank {self.rank}: making NCCL communicator {key} failed: {box['error']!r}"
            ) from box["error"]
        if worker.is_alive():
            raise TransportError(
                f"rank {self.rank}: NCCL communicator {key} was not made within {self.timeout:g} s: every member of "
                f"{list(key.ranks)} must reach its first call on it, with the same unique id from uid_for"
            )
        with self.cp.cuda.Device(self.device):
            stream = self.cp.cuda.Stream(non_blocking=True)
        return _Comm(key, box["handle"], stream, pos)

    def _uid(self, key: CommKey) -> bytes:
        if key == CommKey("collective", self.world):
            return self.uid
        if self.uid_for is None:
            raise TransportError(
                f"rank {self.rank}: communicator {key} is not the world ({list(self.world)}), and NcclTransport "
                "was given no uid_for to make its unique id: pass uid_for=... (the control plane's get-or-create "
                "of an id per CommKey; SharedUids() for ranks in one process)"
            )
        uid = self.uid_for(key)
        if not isinstance(uid, bytes | bytearray) or len(uid) != UID_BYTES:
            raise TransportError(
                f"uid_for({key}) must return {UID_BYTES} bytes (NcclTransport.unique_id()), got {uid!r:.60}"
            )
        return bytes(uid)

    # -- checks ---------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.abort_reason is not None:
            raise TransportAborted(self.abort_reason)
        if self._closed:
            raise TransportError(f"rank {self.rank}: the NCCL transport is closed")

    def _check_peer(self, peer: int, what: str, tag: str) -> None:
        if peer not in self.world:
            raise TransportError(
                f"rank {self.rank}: {what} rank {peer} tag {tag!r}, which is not in this world (ranks {list(self.world)})"
            )

    def _check_group(self, op: str, group: Group, tag: str) -> Group:
        problem = None
        if len(set(group)) != len(group):
            problem = "has repeated ranks"
        elif not set(group) <= set(self.world):
            problem = f"has ranks outside the world {list(self.world)}"
        elif self.rank not in group:
            problem = f"does not contain the calling rank {self.rank}"
        if problem is not None:
            raise TransportError(f"rank {self.rank}: {op} tag {tag!r}: group {group} {problem}")
        return group

    def _axis(self, a: Any, axis: int, tag: str) -> int:
        if not -a.ndim <= axis < a.ndim:
            raise TransportError(
                f"rank {self.rank}: tag {tag!r}: axis {axis} is out of range for an array of shape {a.shape}"
            )
        return axis % a.ndim
