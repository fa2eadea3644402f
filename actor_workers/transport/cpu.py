"""The CPU transport: each rank its own process; shared memory between ranks of one host, TCP between hosts.

A rank binds at construction and publishes its :class:`Endpoint` (through the control plane); ``connect``
then opens one connection to every other rank of the list, and accepts one from each. A rank's
connection to a peer is one-way (see :mod:`cpu_links`): the peer's receive thread always drains it into
per-(source, key) FIFO mailboxes, so a send never waits on the receiver's caller and never deadlocks.
Ranks with the same ``host_id`` use a unix socket (abstract name, nothing on disk) plus a memfd ring for
payloads; others use TCP. A caller that knows where a message must go (a collective's next chunk) posts
the destination first, and the receive thread writes, or adds, the payload straight into it.

Failures: a connection that ends without a goodbye marks its rank lost, and every waiting or later call
that needs that rank raises :class:`TransportError` naming it. ``abort(reason)`` sends an ABORT frame to
every peer; their calls raise :class:`TransportAborted` with the reason. Every wait has ``timeout``.
Collectives are in :mod:`cpu_collectives`.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport import cpu_collectives as coll
from sbpflow.actor_workers.transport.base import Array, Group, TransportAborted, TransportError
from sbpflow.actor_workers.transport.cpu_links import (
    ABORT,
    BYE,
    DATA,
    POLL_S,
    Frame,
    InLink,
    LinkClosed,
    OutLink,
    as_bytes,
    decode_dtype,
    encode_dtype,
    map_ring,
    new_ring,
    recv_hello,
    send_hello,
    set_send_timeout,
    shutdown,
)
from sbpflow.actor_workers.transport.pool import BufferPool


@dataclass(frozen=True)
class Endpoint:
    """What a rank publishes so that its peers can connect to it."""

    rank: int
    host: str  # IP address peers connect to over TCP
    port: int
    host_id: str  # ranks with equal host_id are on one host and use shared memory
    uds: str = ""  # abstract unix socket name ('@' stands for the leading NUL); empty: TCP only


def default_host_id() -> str:
    """This machine's identity: the host name and the kernel's boot id (a rebooted host is another)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(slots=True)
class Message:
    meta: dict[str, Any]
    array: np.ndarray


LOST_GRACE_S = 1.0  # a failed send waits this long for the receive thread to learn why the peer went


@dataclass(slots=True)
class Posted:
    """A destination posted for the next message under one (source, key): filled by the receive thread."""

    src: int
    key: str
    dest: np.ndarray  # raw bytes, contiguous
    base: np.ndarray | None  # raw bytes of the addend: dest = base + payload; None: dest = payload
    dtype: np.dtype[Any]
    done: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    early: Message | None = None  # the message, when it was in the mailbox before the post


class CpuTransport:
    """One rank's :class:`~sbpflow.actor_workers.transport.base.Transport` between processes."""

    def __init__(
        self,
        rank: int,
        host: str = "127.0.0.1",
        host_id: str | None = None,
        timeout: float = 60.0,
        shared_memory: bool = True,
    ) -> None:
        if timeout <= 0:
            raise TransportError(f"CpuTransport timeout must be positive, got {timeout}")
        self.rank = int(rank)
        self.timeout = float(timeout)
        self.shared_memory = shared_memory
        self.pool = BufferPool()  # large results reuse buffers their callers have let go of
        self._cond = threading.Condition()
        self._queues: dict[tuple[int, str], deque[Message]] = {}
        self._posted: dict[tuple[int, str], Posted] = {}
        self._lost: dict[int, str] = {}
        self._abort_reason: str | None = None
        self._closed = False
        self._world: tuple[int, ...] | None = None
        self._out: dict[int, OutLink] = {}
        self._in: dict[int, InLink] = {}
        self._readers: list[threading.Thread] = []
        self._seq: dict[Group, int] = {}
        self._seq_lock = threading.Lock()
        self._tcp = socket.create_server((host, 0), backlog=1024)
        self._unix: socket.socket | None = None
        uds = ""
        if shared_memory:
            uds = f"@sbpflow-{self.rank}-{uuid.uuid4().hex[:16]}"
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._unix.bind("\0" + uds[1:])
            self._unix.listen(1024)
        self.endpoint = Endpoint(
            self.rank, host, self._tcp.getsockname()[1], host_id or default_host_id(), uds
        )
        self._accepting = True
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"sbpflow-cpu-accept-{rank}", daemon=True
        )
        self._acceptor.start()

    # -- connecting ---------------------------------------------------------------------------------

    def connect(self, endpoints: Sequence[Endpoint], timeout: float = 30.0) -> None:
        """Open the full mesh with every other endpoint in ``endpoints`` (which lists this rank too)."""
        self._check_open()
        if self._world is not None:
            raise TransportError(f"rank {self.rank}: connect was already called")
        ranks = [e.rank for e in endpoints]
        if len(set(ranks)) != len(ranks) or self.rank not in ranks:
            raise TransportError(
                f"rank {self.rank}: connect needs distinct ranks including this one, got {ranks}"
            )
        deadline = time.monotonic() + timeout
        peers = [e for e in endpoints if e.rank != self.rank]
        failed: dict[int, str] = {}
        for e in peers:
            try:
                self._out[e.rank] = self._dial(e, deadline)
            except (OSError, LinkClosed, TransportError, ValueError) as exc:
                failed[e.rank] = f"{e.host}:{e.port}{' ' + e.uds if e.uds else ''}: {exc}"
        if failed:
            detail = "; ".join(f"rank {r} at {why}" for r, why in failed.items())
            raise TransportError(
                f"rank {self.rank} could not reach rank(s) {sorted(failed)}: {detail}. Check that those "
                "ranks are running and that their published endpoints are reachable from this host"
            )
        with self._cond:
            while not all(e.rank in self._in for e in peers):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(e.rank for e in peers if e.rank not in self._in)
                    raise TransportError(
                        f"rank {self.rank}: rank(s) {missing} did not connect back within {timeout:g} s; "
                        "every rank must call connect with the same endpoint list"
                    )
                self._cond.wait(min(remaining, POLL_S))
            self._world = tuple(sorted(ranks))
        self._accepting = False
        self._acceptor.join()

    def _dial(self, e: Endpoint, deadline: float) -> OutLink:
        same_host = self.shared_memory and bool(e.uds) and e.host_id == self.endpoint.host_id
        sock: socket.socket | None = None
        if same_host:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                sock.connect("\0" + e.uds.lstrip("@"))
            except OSError:  # another network namespace: fall back to TCP
                if sock is not None:
                    sock.close()
                sock, same_host = None, False
        if sock is None:
            sock = socket.create_connection((e.host, e.port), timeout=max(0.01, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ring = None
        try:
            hello = {"rank": self.rank, "to": e.rank, "shm": same_host}
            if same_host:
                fd, ring = new_ring(self.rank, e.rank)
                try:
                    send_hello(sock, hello, [fd])
                finally:
                    os.close(fd)
            else:
                send_hello(sock, hello, [])
            ack, _ = recv_hello(sock, unix=False)
            if ack.get("rank") != e.rank or not ack.get("ok"):
                raise LinkClosed(f"the listener answered as {ack.get('rank')}: {ack.get('error', 'refused')}")
            sock.settimeout(None)
            set_send_timeout(sock, self.timeout)
        except BaseException:
            sock.close()
            if ring is not None:
                ring.close()
            raise
        return OutLink(e.rank, sock, ring, self.timeout)

    def _accept_loop(self) -> None:
        listeners = [s for s in (self._tcp, self._unix) if s is not None]
        while self._accepting and not self._closed:
            readable, _, _ = select.select(listeners, [], [], 0.05)
            for lst in readable:
                try:
                    sock, _ = lst.accept()
                except OSError:
                    continue
                try:
                    self._admit(sock, unix=lst is self._unix)
                except (OSError, LinkClosed, TransportError, ValueError):
                    sock.close()

    def _admit(self, sock: socket.socket, unix: bool) -> None:
        sock.settimeout(self.timeout)
        if not unix:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello, fds = recv_hello(sock, unix)
        ring = map_ring(fds[0]) if fds else None
        peer, problem = hello.get("rank"), None
        if hello.get("to") != self.rank:
            problem = f"it dialled rank {hello.get('to')}, this is rank {self.rank}"
        elif not isinstance(peer, int) or peer in self._in:
            problem = f"rank {peer} is already connected"
        elif bool(hello.get("shm")) != (ring is not None):
            problem = "a shared-memory link came without its ring"
        if problem is not None:
            send_hello(sock, {"rank": self.rank, "ok": False, "error": problem}, [])
            if ring is not None:
                ring.close()
            raise LinkClosed(problem)
        assert isinstance(peer, int)
        send_hello(sock, {"rank": self.rank, "ok": True}, [])
        sock.settimeout(None)
        set_send_timeout(sock, self.timeout)
        link = InLink(peer, sock, ring)
        reader = threading.Thread(
            target=self._serve, args=(link,), name=f"sbpflow-cpu-recv-{self.rank}<-{peer}", daemon=True
        )
        with self._cond:
            self._in[peer] = link
            self._readers.append(reader)
            self._cond.notify_all()
        reader.start()

    # -- the receive thread -------------------------------------------------------------------------

    def _serve(self, link: InLink) -> None:
        try:
            while True:
                frame = link.frame()
                if frame.kind == DATA:
                    self._receive(link, frame)
                elif frame.kind == ABORT:
                    self._on_abort(str(frame.meta.get("reason", "")))
                elif frame.kind == BYE:
                    self._on_lost(link.peer, f"rank {link.peer} closed its transport")
                    return
                else:
                    raise LinkClosed(f"rank {link.peer} sent an unknown frame type {frame.kind}")
        except (LinkClosed, OSError, ValueError, KeyError, TypeError) as e:
            self._on_lost(link.peer, f"lost the connection to rank {link.peer} ({e})")

    def _receive(self, link: InLink, frame: Frame) -> None:
        key, dtype, shape = frame.meta["k"], decode_dtype(frame.meta["d"]), tuple(frame.meta["s"])
        if int(np.prod(shape)) * dtype.itemsize != frame.nbytes:
            raise LinkClosed(f"rank {link.peer} sent {frame.nbytes} bytes for {dtype}{list(shape)}")
        with self._cond:
            posted = self._posted.pop((link.peer, key), None)
            if posted is not None and (posted.dest.size != frame.nbytes or posted.dtype != dtype):
                posted.error = f"rank {link.peer} sent {dtype}{list(shape)} ({frame.nbytes} bytes)"
                posted.done = True
                posted = None
                self._cond.notify_all()
        if posted is not None:
            if posted.base is None:
                link.payload(frame, posted.dest, None)
            else:
                link.payload(frame, None, _adder(posted))
            with self._cond:
                posted.meta, posted.done = frame.meta, True
                self._cond.notify_all()
            return
        array = self.pool.empty(shape, dtype)
        link.payload(frame, as_bytes(array), None)
        with self._cond:
            self._queues.setdefault((link.peer, key), deque()).append(Message(frame.meta, array))
            self._cond.notify_all()

    def _on_abort(self, reason: str) -> None:
        with self._cond:
            if self._abort_reason is None:
                self._abort_reason = reason
            self._cond.notify_all()

    def _on_lost(self, peer: int, why: str) -> None:
        with self._cond:
            self._lost.setdefault(peer, why)
            self._cond.notify_all()

    # -- what the collectives build on --------------------------------------------------------------

    def next_seq(self, group: Group) -> int:
        with self._seq_lock:
            seq = self._seq.get(group, 0)
            self._seq[group] = seq + 1
            return seq

    def post_send(self, dst: int, key: str, array: np.ndarray, extra: dict[str, Any] | None = None) -> None:
        """Send a C-contiguous ``array`` to ``dst`` under mailbox ``key``."""
        meta = {"k": key, "d": encode_dtype(array.dtype), "s": list(array.shape), **(extra or {})}
        if dst == self.rank:
            with self._cond:
                self._queues.setdefault((dst, key), deque()).append(Message(meta, array.copy()))
                self._cond.notify_all()
            return
        self._check_peer(dst, f"send {key!r} to")
        try:
            self._out[dst].send(DATA, meta, as_bytes(array))
        except LinkClosed as e:
            with self._cond:  # the peer's own goodbye (or EOF) may be in flight on its link: it says why
                self._cond.wait_for(lambda: dst in self._lost, timeout=LOST_GRACE_S)
            self._on_lost(dst, f"lost the connection to rank {dst} ({e})")
            self._check_peer(dst, f"send {key!r} to")
            raise TransportError(f"rank {self.rank}: send {key!r} to rank {dst} failed: {e}") from e

    def take(self, src: int, key: str, what: str, deadline: float) -> Message:
        """The oldest message from ``src`` under ``key``, waiting until ``deadline``."""
        with self._cond:
            q = self._wait(src, what, deadline, lambda: bool(self._queues.get((src, key))))
            assert q is not None
            message = self._queues[(src, key)].popleft()
            if not self._queues[(src, key)]:
                del self._queues[(src, key)]
            return message

    def post(
        self, src: int, key: str, dest: np.ndarray, base: np.ndarray | None, dtype: np.dtype[Any]
    ) -> Posted:
        """Post ``dest`` (raw bytes) for the one message from ``src`` under ``key``: the receive thread
        writes it there, as ``base + payload`` when ``base`` is given. ``collect`` waits for it."""
        posted = Posted(src, key, dest, base, dtype)
        with self._cond:
            q = self._queues.get((src, key))
            if q:  # it came first
                posted.early = q.popleft()
                if not q:
                    del self._queues[(src, key)]
            else:
                self._posted[(src, key)] = posted
        return posted

    def unpost(self, posted: Posted) -> None:
        with self._cond:
            if self._posted.get((posted.src, posted.key)) is posted:
                del self._posted[(posted.src, posted.key)]

    def collect(self, posted: Posted, what: str, deadline: float) -> dict[str, Any]:
        """Wait until ``posted`` is filled; returns the message's header."""
        src, key = posted.src, posted.key
        message = posted.early
        if message is None:
            with self._cond:
                unclaimed = lambda: self._posted.get((src, key)) is posted  # noqa: E731
                try:
                    self._wait(
                        src,
                        what,
                        deadline,
                        lambda: posted.done or (unclaimed() and bool(self._queues.get((src, key)))),
                    )
                except TransportError:
                    self.unpost(posted)
                    raise
                if posted.done:
                    if posted.error is not None:
                        raise TransportError(f"rank {self.rank}: {what} rank {src}: {posted.error}")
                    return posted.meta
                del self._posted[(src, key)]  # it was read before the post: take it from the mailbox
                message = self._queues[(src, key)].popleft()
                if not self._queues[(src, key)]:
                    del self._queues[(src, key)]
        got = as_bytes(np.ascontiguousarray(message.array))
        if got.size != posted.dest.size or message.array.dtype != posted.dtype:
            raise TransportError(
                f"rank {self.rank}: {what} rank {src}: got {message.array.dtype}{list(message.array.shape)}, "
                f"expected {posted.dest.size} bytes of {posted.dtype}"
            )
        _adder(posted)(0, got)
        return message.meta

    def _wait(self, src: int, what: str, deadline: float, ready: Callable[[], bool]) -> bool:
        """Wait (holding the lock) until ``ready()``; raise on abort, close, loss of ``src`` or timeout."""
        while True:
            self._check_open()
            if ready():
                return True
            if src in self._lost:
                raise TransportError(f"rank {self.rank}: {what} rank {src} failed: {self._lost[src]}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"rank {self.rank} waited {self.timeout:g} s to {what} rank {src} and nothing arrived "
                    f"(waiting here: {self._pending()}); the peer never sent it, sent it under another tag, "
                    "or is stuck: check the communicator order, or give CpuTransport a longer timeout"
                )
            self._cond.wait(min(remaining, 1.0))

    def _pending(self) -> str:
        return ", ".join(f"from rank {s} {k!r} ({len(q)})" for (s, k), q in self._queues.items()) or "none"

    def check_members(self, kind: str, tag: str, group: Group) -> int:
        """This rank's position in ``group``, after checking the group against the connected world."""
        self._check_open()
        world = self._require_world()
        problem = None
        if len(set(group)) != len(group):
            problem = "has repeated ranks"
        elif not set(group) <= set(world):
            problem = f"has ranks outside the world {list(world)}"
        elif self.rank not in group:
            problem = f"does not contain the calling rank {self.rank}"
        if problem is not None:
            raise TransportError(f"rank {self.rank}: {kind} tag {tag!r}: group {group} {problem}")
        for r in group:
            if r != self.rank:
                self._check_peer(r, f"{kind} tag {tag!r} with")
        return group.index(self.rank)

    def _check_peer(self, peer: int, what: str) -> None:
        self._check_open()
        world = self._require_world()
        if peer not in world:
            raise TransportError(
                f"rank {self.rank}: {what} rank {peer}, which is not in this world (ranks {list(world)})"
            )
        if peer in self._lost:
            raise TransportError(f"rank {self.rank}: {what} rank {peer} failed: {self._lost[peer]}")

    def _require_world(self) -> tuple[int, ...]:
        if self._world is None:
            raise TransportError(f"rank {self.rank}: call connect(endpoints) before sending or receiving")
        return self._world

    def _check_open(self) -> None:
        reason = self._abort_reason
        if reason is not None:
            raise TransportAborted(reason)
        if self._closed:
            raise TransportError(f"rank {self.rank}: the transport is closed")

    # -- the Transport interface --------------------------------------------------------------------

    def send(self, array: Array, dst: int, tag: str) -> None:
        self._check_peer(dst, f"send tag {tag!r} to")
        self.post_send(dst, "p:" + tag, coll.contiguous(array))

    def recv(self, src: int, tag: str) -> Array:
        self._check_open()
        world = self._require_world()
        if src not in world:
            raise TransportError(
                f"rank {self.rank}: recv tag {tag!r} from rank {src}, which is not in this world "
                f"(ranks {list(world)})"
            )
        what = f"recv tag {tag!r} from"
        return self.take(src, "p:" + tag, what, time.monotonic() + self.timeout).array

    def all_reduce(self, array: Array, group: Group, tag: str) -> Array:
        return coll.all_reduce(self, array, tuple(group), tag)

    def reduce_scatter(self, array: Array, group: Group, axis: int, tag: str) -> Array:
        return coll.reduce_scatter(self, array, tuple(group), axis, tag)

    def all_gather(self, array: Array, group: Group, axis: int, tag: str) -> Array:
        return coll.all_gather(self, array, tuple(group), axis, tag)

    def all_to_all(self, array: Array, group: Group, split_axis: int, concat_axis: int, tag: str) -> Array:
        return coll.all_to_all(self, array, tuple(group), split_axis, concat_axis, tag)

    def broadcast(self, array: Array | None, root: int, group: Group, tag: str) -> Array:
        return coll.broadcast(self, array, root, tuple(group), tag)

    def abort(self, reason: str) -> None:
        """Fail every blocked and later call here and on every connected peer with ``reason``."""
        self._on_abort(reason)
        for link in list(self._out.values()):
            try:
                link.send(ABORT, {"reason": reason})
            except (LinkClosed, TransportError):
                pass  # that peer is gone or wedged; it learns from the closed connection instead

    def close(self) -> None:
        """Say goodbye to every peer, stop the receive threads, close the sockets, unmap the rings."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._accepting = False
        if self._acceptor.is_alive() and self._acceptor is not threading.current_thread():
            self._acceptor.join()
        for out in self._out.values():
            out.close(goodbye=True)
        for inlink in self._in.values():
            shutdown(inlink.sock)
        for reader in self._readers:
            reader.join(self.timeout)
        for inlink in self._in.values():
            inlink.close()
        for s in (self._tcp, self._unix):
            if s is not None:
                s.close()

    def __enter__(self) -> CpuTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _adder(posted: Posted) -> Callable[[int, np.ndarray], None]:
    """Write a chunk of payload bytes at ``offset`` of ``posted.dest``: a copy, or a sum with its base."""
    dest, base, dt = posted.dest, posted.base, posted.dtype

    def write(offset: int, chunk: np.ndarray) -> None:
        end = offset + chunk.size
        if base is None:
            np.copyto(dest[offset:end], chunk)
        else:
            np.add(base[offset:end].view(dt), chunk.view(dt), out=dest[offset:end].view(dt))

    return write
