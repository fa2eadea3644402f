"""The receiving side of one CPU-transport rank: mailboxes, posted destinations, and what every wait checks.

Messages arrive (from the receive threads, or from the rank itself) under a (source, key) and queue in
that pair's FIFO mailbox, unless a caller posted a destination for the pair first: then the receive
thread writes the payload straight into it, or adds it to the posted base (:func:`adder`). A post that
finds its message already queued takes it from the mailbox instead. One condition guards it all, and
every wait wakes on it and raises, naming the rank and what it waited for, when the transport was
aborted (:class:`TransportAborted`) or closed, when the awaited peer is lost, or at its deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport.base import TransportAborted, TransportError
from sbpflow.actor_workers.transport.cpu.links import as_bytes

WAKE_S = 1.0  # a wait looks again at least this often


@dataclass(slots=True)
class Message:
    meta: dict[str, Any]
    array: np.ndarray


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


class Mailboxes:
    """Rank ``rank``'s mailboxes and the state its waits check: lost peers, the abort reason, closed."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self.cond = threading.Condition()
        self.lost: dict[int, str] = {}  # peer -> why it is gone
        self.abort_reason: str | None = None
        self.closed = False
        self._queues: dict[tuple[int, str], deque[Message]] = {}
        self._posted: dict[tuple[int, str], Posted] = {}

    # -- arriving -----------------------------------------------------------------------------------

    def put(self, src: int, key: str, message: Message) -> None:
        """Queue ``message`` in the mailbox of (``src``, ``key``)."""
        with self.cond:
            self._queues.setdefault((src, key), deque()).append(message)
            self.cond.notify_all()

    def claim(
        self, src: int, key: str, dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int
    ) -> Posted | None:
        """The destination posted for an arriving message, now the receive thread's to fill; None when
        there is none (queue the message) or it does not fit (the post fails with what came)."""
        with self.cond:
            posted = self._posted.pop((src, key), None)
            if posted is not None and (posted.dest.size != nbytes or posted.dtype != dtype):
                posted.error = f"rank {src} sent {dtype}{list(shape)} ({nbytes} bytes)"
                posted.done = True
                posted = None
                self.cond.notify_all()
        return posted

    def filled(self, posted: Posted, meta: dict[str, Any]) -> None:
        """Mark a claimed ``posted`` written, with its message's header."""
        with self.cond:
            posted.meta, posted.done = meta, True
            self.cond.notify_all()

    def on_abort(self, reason: str) -> None:
        with self.cond:
            if self.abort_reason is None:
                self.abort_reason = reason
            self.cond.notify_all()

    def on_lost(self, peer: int, why: str) -> None:
        with self.cond:
            self.lost.setdefault(peer, why)
            self.cond.notify_all()

    def close(self) -> bool:
        """Fail every wait from now on; False when it was closed already."""
        with self.cond:
            if self.closed:
                return False
            self.closed = True
            self.cond.notify_all()
            return True

    # -- taking -------------------------------------------------------------------------------------

    def take(self, src: int, key: str, what: str, deadline: float) -> Message:
        """The oldest message from ``src`` under ``key``, waiting until ``deadline``."""
        with self.cond:
            self.wait(src, what, deadline, lambda: bool(self._queues.get((src, key))))
            return self._pop(src, key)

    def _pop(self, src: int, key: str) -> Message:
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
        with self.cond:
            if self._queues.get((src, key)):  # it came first
                posted.early = self._pop(src, key)
            else:
                self._posted[(src, key)] = posted
        return posted

    def unpost(self, posted: Posted) -> None:
        with self.cond:
            if self._posted.get((posted.src, posted.key)) is posted:
                del self._posted[(posted.src, posted.key)]

    def collect(self, posted: Posted, what: str, deadline: float) -> dict[str, Any]:
        """Wait until ``posted`` is filled; returns the message's header."""
        src, key = posted.src, posted.key
        message = posted.early
        if message is None:
            with self.cond:
                unclaimed = lambda: self._posted.get((src, key)) is posted  # noqa: E731
                try:
                    self.wait(
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
                message = self._pop(src, key)
        got = as_bytes(np.ascontiguousarray(message.array))
        if got.size != posted.dest.size or message.array.dtype != posted.dtype:
            raise TransportError(
                f"rank {self.rank}: {what} rank {src}: got {message.array.dtype}{list(message.array.shape)}, "
                f"expected {posted.dest.size} bytes of {posted.dtype}"
            )
        adder(posted)(0, got)
        return message.meta

    # -- waiting ------------------------------------------------------------------------------------

    def wait(self, src: int, what: str, deadline: float, ready: Callable[[], bool]) -> bool:
        """Wait (holding the lock) until ``ready()``; raise on abort, close, loss of ``src`` or timeout."""
        while True:
            self.check_open()
            if ready():
                return True
            if src in self.lost:
                raise TransportError(f"rank {self.rank}: {what} rank {src} failed: {self.lost[src]}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"rank {self.rank} waited {self.timeout:g} s to {what} rank {src} and nothing arrived "
                    f"(waiting here: {self._pending()}); the peer never sent it, sent it under another tag, "
                    "or is stuck: check the communicator order, or give CpuTransport a longer timeout"
                )
            self.cond.wait(min(remaining, WAKE_S))

    def _pending(self) -> str:
        return ", ".join(f"from rank {s} {k!r} ({len(q)})" for (s, k), q in self._queues.items()) or "none"

    def check_open(self) -> None:
        reason = self.abort_reason
        if reason is not None:
            raise TransportAborted(reason)
        if self.closed:
            raise TransportError(f"rank {self.rank}: the transport is closed")


def adder(posted: Posted) -> Callable[[int, np.ndarray], None]:
    """Write a chunk of payload bytes at ``offset`` of ``posted.dest``: a copy, or a sum with its base."""
    dest, base, dt = posted.dest, posted.base, posted.dtype

    def write(offset: int, chunk: np.ndarray) -> None:
        end = offset + chunk.size
        if base is None:
            np.copyto(dest[offset:end], chunk)
        else:
            np.add(base[offset:end].view(dt), chunk.view(dt), out=dest[offset:end].view(dt))

    return write
