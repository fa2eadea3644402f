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
Connection set-up (listening, dialing, the handshake) is in :mod:`cpu_connect`, the mailboxes and their
waits in :mod:`cpu_mailbox`, the collectives in :mod:`cpu_collectives`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport.base import Array, Group, TransportError
from sbpflow.actor_workers.transport.cpu import collectives as coll
from sbpflow.actor_workers.transport.cpu.connect import Endpoint, Listener, default_host_id, dial
from sbpflow.actor_workers.transport.cpu.links import (
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
    shutdown,
)
from sbpflow.actor_workers.transport.cpu.mailbox import Mailboxes, Message, Posted, adder
from sbpflow.actor_workers.transport.pool import BufferPool

LOST_GRACE_S = 1.0  # a failed send waits this long for the receive thread to learn why the peer went


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
        self._mail = Mailboxes(self.rank, self.timeout)
        self._cond = self._mail.cond  # also guards the links and the world
        self._lost = self._mail.lost
        self._world: tuple[int, ...] | None = None
        self._out: dict[int, OutLink] = {}
        self._in: dict[int, InLink] = {}
        self._readers: list[threading.Thread] = []
        self._seq: dict[Group, int] = {}
        self._seq_lock = threading.Lock()
        self._listener = Listener(
            self.rank,
            host,
            host_id or default_host_id(),
            shared_memory,
            self.timeout,
            connected=lambda peer: peer in self._in,
            on_link=self._on_link,
        )
        self.endpoint = self._listener.endpoint

    # -- connecting ---------------------------------------------------------------------------------

    def connect(self, endpoints: Sequence[Endpoint], timeout: float = 30.0) -> None:
        """Open the full mesh with every other endpoint in ``endpoints`` (which lists this rank too)."""
        self._mail.check_open()
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
                self._out[e.rank] = dial(self.endpoint, e, self.shared_memory, deadline, self.timeout)
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
        self._listener.stop()

    def _on_link(self, link: InLink) -> None:
        """Take a link a peer opened to this rank: start the thread that drains it."""
        reader = threading.Thread(
            target=self._serve, args=(link,), name=f"sbpflow-cpu-recv-{self.rank}<-{link.peer}", daemon=True
        )
        with self._cond:
            self._in[link.peer] = link
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
                    self._mail.on_abort(str(frame.meta.get("reason", "")))
                elif frame.kind == BYE:
                    self._mail.on_lost(link.peer, f"rank {link.peer} closed its transport")
                    return
                else:
                    raise LinkClosed(f"rank {link.peer} sent an unknown frame type {frame.kind}")
        except (LinkClosed, OSError, ValueError, KeyError, TypeError) as e:
            self._mail.on_lost(link.peer, f"lost the connection to rank {link.peer} ({e})")

    def _receive(self, link: InLink, frame: Frame) -> None:
        key, dtype, shape = frame.meta["k"], decode_dtype(frame.meta["d"]), tuple(frame.meta["s"])
        if int(np.prod(shape)) * dtype.itemsize != frame.nbytes:
            raise LinkClosed(f"rank {link.peer} sent {frame.nbytes} bytes for {dtype}{list(shape)}")
        posted = self._mail.claim(link.peer, key, dtype, shape, frame.nbytes)
        if posted is not None:
            if posted.base is None:
                link.payload(frame, posted.dest, None)
            else:
                link.payload(frame, None, adder(posted))
            self._mail.filled(posted, frame.meta)
            return
        array = self.pool.empty(shape, dtype)
        link.payload(frame, as_bytes(array), None)
        self._mail.put(link.peer, key, Message(frame.meta, array))

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
            self._mail.put(dst, key, Message(meta, array.copy()))
            return
        self._check_peer(dst, f"send {key!r} to")
        try:
            self._out[dst].send(DATA, meta, as_bytes(array))
        except LinkClosed as e:
            with self._cond:  # the peer's own goodbye (or EOF) may be in flight on its link: it says why
                self._cond.wait_for(lambda: dst in self._lost, timeout=LOST_GRACE_S)
            self._mail.on_lost(dst, f"lost the connection to rank {dst} ({e})")
            self._check_peer(dst, f"send {key!r} to")
            raise TransportError(f"rank {self.rank}: send {key!r} to rank {dst} failed: {e}") from e

    def take(self, src: int, key: str, what: str, deadline: float) -> Message:
        """The oldest message from ``src`` under ``key``, waiting until ``deadline``."""
        return self._mail.take(src, key, what, deadline)

    def post(
        self, src: int, key: str, dest: np.ndarray, base: np.ndarray | None, dtype: np.dtype[Any]
    ) -> Posted:
        """Post ``dest`` (raw bytes) for the one message from ``src`` under ``key``: the receive thread
        writes it there, as ``base + payload`` when ``base`` is given. ``collect`` waits for it."""
        return self._mail.post(src, key, dest, base, dtype)

    def unpost(self, posted: Posted) -> None:
        self._mail.unpost(posted)

    def collect(self, posted: Posted, what: str, deadline: float) -> dict[str, Any]:
        """Wait until ``posted`` is filled; returns the message's header."""
        return self._mail.collect(posted, what, deadline)

    def check_members(self, kind: str, tag: str, group: Group) -> int:
        """This rank's position in ``group``, after checking the group against the connected world."""
        self._mail.check_open()
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
        self._mail.check_open()
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

    # -- the Transport interface --------------------------------------------------------------------

    def send(self, array: Array, dst: int, tag: str) -> None:
        self._check_peer(dst, f"send tag {tag!r} to")
        self.post_send(dst, "p:" + tag, coll.contiguous(array))

    def recv(self, src: int, tag: str) -> Array:
        self._mail.check_open()
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
        self._mail.on_abort(reason)
        for link in list(self._out.values()):
            try:
                link.send(ABORT, {"reason": reason})
            except (LinkClosed, TransportError):
                pass  # that peer is gone or wedged; it learns from the closed connection instead

    def close(self) -> None:
        """Say goodbye to every peer, stop the receive threads, close the sockets, unmap the rings."""
        if not self._mail.close():
            return
        self._listener.stop()
        for out in self._out.values():
            out.close(goodbye=True)
        for inlink in self._in.values():
            shutdown(inlink.sock)
        for reader in self._readers:
            reader.join(self.timeout)
        for inlink in self._in.values():
            inlink.close()
        self._listener.close()

    def __enter__(self) -> CpuTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
