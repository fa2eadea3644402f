"""The NCCL transport: the data plane between GPU workers, on cupy arrays through ``cupy.cuda.nccl``.

One :class:`NcclTransport` per rank (one process or thread per GPU). Its parts:

    nccl_wire         the dtype table, the call headers, the check that one round's members agree
    nccl_comms        communicators (bootstrap, ``CommKey``, lazy creation) and the stream discipline
    nccl_collectives  one function per collective, run after its header round
    nccl (this)       the transport: its arguments, send/recv, the collectives' header round, lifecycle

Rules and design choices (the others are in those modules' docstrings):

- **Bootstrap.** ``uid_for`` (every communicator but the world's) must return the same id to every
  member of a key: the control plane implements it as get-or-create in its key-value store (the first
  member to ask makes the id with ``unique_id()``); :class:`SharedUids` is that for ranks in one process
  (threads, tests).
- **Headers.** Every collective first all-gathers a small int64 header per member (``nccl_wire``), so
  members that disagree get a :class:`TransportError` naming both sides instead of garbage or a hang. The
  host waits for the header (with ``timeout``), never for the payload. A plan's shapes and dtypes are
  static, so a worker makes its transport with ``static_shapes=True``: only the first call under each
  (communicator, tag) has the header round, and later ones reuse its headers (a later call that differs
  from the first, but for its number, is refused on the rank that made it). Point-to-point messages keep
  their header (a recv learns the shape from it, and may take messages out of tag order).
- **Send/recv.** A message is a header then its payload on the ``p2p:src->dst`` communicator, one per
  direction, so a send from a to b never waits behind a recv from b. ``send`` copies the array and
  returns at once (making a communicator is a rendezvous the peer joins at its first recv, so a send to a
  peer with none yet queues, and a thread makes it and sends the queue in order); ``recv`` waits for the
  header, keeps messages of other tags aside (FIFO per (src, tag), as the contract says), and returns
  without waiting for the payload. A rank sending to itself goes through a local mailbox (NCCL has no
  one-member pair).
- **Abort.** ``abort(reason)`` aborts every communicator of this rank (ncclCommAbort ends its kernels),
  makes every blocked and later call raise ``TransportAborted(reason)`` and calls ``on_abort(reason)``
  once: the control plane's hook that aborts the other ranks. A timeout aborts too (a hung NCCL call
  never returns). Inputs stay referenced until their NCCL call is done, so freeing them is safe.
- Without cupy, importing this module works; constructing a transport raises the install hint.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport.base import Group, TransportAborted, TransportError, check_broadcast
from sbpflow.actor_workers.transport.nccl.collectives import RUN, Call
from sbpflow.actor_workers.transport.nccl.comms import (
    UID_BYTES,
    Comm,
    CommKey,
    NcclComms,
    UidFor,
    import_nccl,
)
from sbpflow.actor_workers.transport.nccl.headers import (
    HEADER_WORDS,
    NCCL_TYPES,
    Header,
    check_round,
    decode,
    encode,
    nccl_type,
    same_call,
    tag_hash,
)


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


class NcclTransport(NcclComms):
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
        static_shapes: bool = False,
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
        super().__init__(rank, world, uid, device, uid_for, timeout)  # needs cupy: the install hint if not
        self.on_abort = on_abort
        self.static_shapes = static_shapes
        # (communicator, tag) -> (this member's header words, every member's header) of the first call
        self._rounds: dict[tuple[CommKey, str], tuple[np.ndarray, list[Header]]] = {}
        self._closed = False
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
        return bytes(b & 0xFF for b in import_nccl().get_unique_id())

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

    def _send_on(self, comm: Comm, tag: str, x: Any, ready: Any) -> None:
        """A header, then the payload, to the peer of a p2p communicator (after ``ready``, if given)."""
        comm.calls += 1
        words = encode("send", tag, (), x.dtype, x.shape, comm.calls)
        kind, code = nccl_type(x.dtype), NCCL_TYPES[np.dtype(np.int64)].code

        def body() -> Any:  # on the comm stream: the header's copy to the device too
            head = self.cp.asarray(words)
            comm.handle.send(head.data.ptr, HEADER_WORDS, code, 1, comm.stream.ptr)
            if x.size:
                comm.handle.send(x.data.ptr, x.size, kind.code, 1, comm.stream.ptr)
            return head

        self.run(comm, body, inputs=(x,), ready=ready, wait=False)

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

    def _next_message(self, comm: Comm, what: str) -> tuple[Header, Any]:
        """The next message on a p2p communicator: wait for its header, then post the payload's recv."""
        comm.calls += 1
        code = NCCL_TYPES[np.dtype(np.int64)].code

        def post_header() -> Any:
            head = self.cp.empty(HEADER_WORDS, np.int64)
            comm.handle.recv(head.data.ptr, HEADER_WORDS, code, 0, comm.stream.ptr)
            return head

        head, done = self.run(comm, post_header, wait=False)
        self._wait(done, comm, f"{what} (message #{comm.calls})")
        got = decode(head.get(stream=comm.stream))
        assert got.dtype is not None and got.shape is not None

        def post_payload() -> Any:
            x = self.cp.empty(got.shape, got.dtype)
            if x.size:
                comm.handle.recv(x.data.ptr, x.size, nccl_type(x.dtype).code, 0, comm.stream.ptr)
            return x

        x, _ = self.run(comm, post_payload)
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
        group = check_broadcast(self.rank, array, root, group, tag)
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
                mine = encode(op, tag, meta, dtype, shape, comm.calls)
                call = Call(self, comm, x, meta, self._round(comm, group, tag, mine))
                out, _ = self.run(comm, lambda: RUN[op](call), () if x is None else (x,), call.kept)
                return out

    def _round(self, comm: Comm, group: Group, tag: str, mine: np.ndarray) -> list[Header]:
        """Every member's header of this call: all-gathered and checked, or, with ``static_shapes``, those
        of the first call under ``tag`` on ``comm`` (this member's call must be the same but its number)."""
        first = self._rounds.get((comm.key, tag)) if self.static_shapes else None
        if first is not None:
            if not same_call(first[0], mine):
                raise TransportError(
                    f"rank {self.rank}: {decode(mine).describe()} on group {group} differs from the first call "
                    f"under that tag, {decode(first[0]).describe()}, but the transport was made with "
                    "static_shapes=True (each tag's call fixed by the plan); make it with static_shapes=False "
                    "for dynamic shapes"
                )
            return first[1]
        code = NCCL_TYPES[np.dtype(np.int64)].code

        def gather() -> Any:
            words, every = self.cp.asarray(mine), self.cp.empty((len(group), HEADER_WORDS), np.int64)
            comm.handle.allGather(words.data.ptr, every.data.ptr, HEADER_WORDS, code, comm.stream.ptr)
            return every

        every, done = self.run(comm, gather, wait=False)
        what = f"{decode(mine).op} tag {tag!r} (collective #{comm.calls} of group {group})"
        self._wait(done, comm, what)
        headers = [decode(row) for row in every.get(stream=comm.stream)]
        check_round(headers, group)
        if self.static_shapes:
            self._rounds[(comm.key, tag)] = (mine, headers)
        return headers

    # -- lifecycle ------------------------------------------------------------------------------------

    def _aborted(self, reason: str) -> None:
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
        self._destroy_comms()

    def __enter__(self) -> NcclTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
