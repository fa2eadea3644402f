"""The wire of the CPU transport: frames, and one-way links that carry them between two ranks.

Every ordered pair of ranks (a, b) has its own connection, opened by a and read only by b's receive
thread, so a sender never waits on a reader that is itself sending. A connection carries frames:

    header <type:u8, meta_len:u32, payload_len:u64, flags:u8> | meta (JSON) | payload

- Between hosts (TCP) the payload follows its header on the socket and is read with ``recv_into``
  straight into the destination array (a small one through the reader's buffer).
- The reader reads ahead into a buffer of ``READ_BYTES``: a frame's header, its meta, a chunk notice
  and a small payload come in one ``recv``, not one each. Every blocking call of a Python thread gives
  up the GIL and takes it back, and on a busy worker taking it back waits for the compute thread.
- On one host (unix socket) a payload above ``INLINE_BYTES`` travels through a ring of ``SLOTS`` slots in
  a ``memfd`` that the sender created and passed to the reader with ``SCM_RIGHTS`` when the link opened:
  the sender copies a chunk into a free slot and sends a CHUNK frame naming it (the first with the
  message's header, in one send); the reader copies (or adds) it into the destination and writes the slot number back on the same socket (the only bytes that
  ever flow against a link's direction). No file exists in /dev/shm, and the kernel frees the memory
  when the last process holding it exits, SIGKILL included.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sbpflow.actor_workers.transport.base import TransportError

HEADER = struct.Struct("<BIQB")
CHUNK = struct.Struct("<IQ")  # slot, bytes
CREDIT = struct.Struct("<I")
DATA, ABORT, BYE = 1, 2, 3
CHUNKED = 1  # header flag: the payload comes as CHUNK frames through the ring

SLOT_BYTES = 4 << 20  # one ring slot; a multiple of every itemsize so chunks never cut an element
SLOTS = 4
INLINE_BYTES = 64 << 10  # below this a same-host payload rides on the socket itself
TCP_CHUNK = 4 << 20  # scratch used only when a TCP payload is added (not copied) into its destination
READ_BYTES = 256 << 10  # the reader's read-ahead buffer; a payload's rest above a quarter of it skips it
POLL_S = 0.2  # how often a waiting sender looks at the deadline and the transport's state

Sink = Callable[[int, np.ndarray], None]  # (byte offset, chunk of raw bytes) -> copy/add it in place


class LinkClosed(Exception):
    """The connection ended (EOF, reset, shutdown); the reader turns it into 'rank X lost'."""


@dataclass(frozen=True)
class Frame:
    kind: int
    meta: dict[str, Any]
    nbytes: int
    chunked: bool


def encode(kind: int, meta: dict[str, Any], nbytes: int = 0, chunked: bool = False) -> bytes:
    body = json.dumps(meta, separators=(",", ":")).encode()
    return HEADER.pack(kind, len(body), nbytes, CHUNKED if chunked else 0) + body


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """A blocking send that cannot finish in ``seconds`` fails instead of hanging (SO_SNDTIMEO)."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


def read_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except OSError as e:
            raise LinkClosed(f"{e.strerror or e}") from e
        if k == 0:
            raise LinkClosed("connection closed")
        got += k


def as_bytes(a: np.ndarray) -> np.ndarray:
    """The raw bytes of a C-contiguous array as a flat uint8 view (0-d and empty arrays included)."""
    return a.reshape(-1).view(np.uint8)


# -- the sending end --------------------------------------------------------------------------------


class OutLink:
    """This rank's end of the connection to ``peer``; callers send whole messages under ``lock``."""

    def __init__(self, peer: int, sock: socket.socket, ring: mmap.mmap | None, timeout: float) -> None:
        self.peer = peer
        self.sock = sock
        self.lock = threading.Lock()
        self.timeout = timeout
        self.ring = ring
        self.slots = None if ring is None else np.frombuffer(ring, np.uint8).reshape(SLOTS, SLOT_BYTES)
        self.free: deque[int] = deque(range(SLOTS))
        self.credit_buf = bytearray()
        self.broken: str | None = None

    def send(self, kind: int, meta: dict[str, Any], payload: np.ndarray | None = None) -> None:
        """Send one frame (and its payload, raw bytes); the caller holds no lock."""
        if not self.lock.acquire(timeout=self.timeout):
            raise TransportError(
                f"could not send to rank {self.peer} for {self.timeout:g} s: its link is busy"
            )
        try:
            if self.broken is not None:
                raise LinkClosed(self.broken)
            try:
                self._send_locked(kind, meta, payload)
            except (OSError, LinkClosed) as e:
                self.broken = f"{e}"
                raise LinkClosed(self.broken) from e
        finally:
            self.lock.release()

    def _send_locked(self, kind: int, meta: dict[str, Any], payload: np.ndarray | None) -> None:
        n = 0 if payload is None else payload.size
        chunked = self.slots is not None and n > INLINE_BYTES
        head = encode(kind, meta, n, chunked)
        if payload is None or n == 0:
            self.sock.sendall(head)
        elif not chunked:
            if n <= INLINE_BYTES:
                self.sock.sendall(head + payload.tobytes())
            else:
                self.sock.sendall(head)
                self.sock.sendall(memoryview(payload))  # type: ignore[arg-type]
        else:
            assert self.slots is not None
            for off in range(0, n, SLOT_BYTES):
                m = min(SLOT_BYTES, n - off)
                slot = self._take_slot()
                np.copyto(self.slots[slot, :m], payload[off : off + m])
                notice = CHUNK.pack(slot, m)
                self.sock.sendall(notice if off else head + notice)  # the header with the first: one send

    def _take_slot(self) -> int:
        """A free ring slot, reading the reader's credits (blocking, with the deadline) when none is."""
        deadline = time.monotonic() + self.timeout
        while not self.free:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise LinkClosed(f"rank {self.peer} freed no shared-memory slot for {self.timeout:g} s")
            readable, _, _ = select.select([self.sock], [], [], min(wait, POLL_S))
            if not readable:
                continue
            data = self.sock.recv(CREDIT.size * SLOTS)
            if not data:
                raise LinkClosed("connection closed")
            self.credit_buf += data
            usable = len(self.credit_buf) - len(self.credit_buf) % CREDIT.size
            for (slot,) in CREDIT.iter_unpack(bytes(self.credit_buf[:usable])):
                self.free.append(slot)
            del self.credit_buf[:usable]
        return self.free.popleft()

    def close(self, goodbye: bool) -> None:
        if goodbye and self.lock.acquire(timeout=min(1.0, self.timeout)):
            try:
                if self.broken is None:
                    self.sock.sendall(encode(BYE, {}))
            except OSError:
                pass
            finally:
                self.lock.release()
        shutdown(self.sock)
        self.sock.close()
        self.slots = None
        if self.ring is not None:
            self.ring.close()


# -- the receiving end ------------------------------------------------------------------------------


class InLink:
    """``peer``'s connection to this rank, read by one receive thread."""

    def __init__(self, peer: int, sock: socket.socket, ring: mmap.mmap | None) -> None:
        self.peer = peer
        self.sock = sock
        self.ring = ring
        self.slots = None if ring is None else np.frombuffer(ring, np.uint8).reshape(SLOTS, SLOT_BYTES)
        self.scratch: np.ndarray | None = None
        self._buf = bytearray(READ_BYTES)  # read ahead: [_lo, _hi) is received and not yet taken
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0

    def frame(self) -> Frame:
        kind, meta_len, nbytes, flags = HEADER.unpack(self._take(HEADER.size))
        meta = json.loads(self._bytes(meta_len)) if meta_len else {}
        return Frame(kind, meta, nbytes, bool(flags & CHUNKED))

    def _recv(self) -> None:
        """Receive what the socket has (at least a byte) after the unread part of the buffer."""
        if self._lo == self._hi:
            self._lo = self._hi = 0
        try:
            k = self.sock.recv_into(self._view[self._hi :])
        except OSError as e:
            raise LinkClosed(f"{e.strerror or e}") from e
        if k == 0:
            raise LinkClosed("connection closed")
        self._hi += k

    def _take(self, n: int) -> memoryview:
        """The next ``n`` bytes (at most ``READ_BYTES``), valid until the next read."""
        if self._hi - self._lo < n:
            if self._lo + n > len(self._buf):  # no room after the unread part: move it to the front
                k = self._hi - self._lo
                self._buf[:k] = self._buf[self._lo : self._hi]
                self._lo, self._hi = 0, k
            while self._hi - self._lo < n:
                self._recv()
        view = self._view[self._lo : self._lo + n]
        self._lo += n
        return view

    def _bytes(self, n: int) -> bytes | bytearray:
        if n <= len(self._buf):
            return bytes(self._take(n))
        body = bytearray(n)
        self._read_into(memoryview(body))
        return body

    def _read_into(self, dest: memoryview) -> None:
        """Fill ``dest``: first from the buffer, then a large rest straight from the socket."""
        n = len(dest)
        got = min(n, self._hi - self._lo)
        dest[:got] = self._view[self._lo : self._lo + got]
        self._lo += got
        if n - got > len(self._buf) // 4:
            read_exact(self.sock, dest[got:])
            return
        while got < n:
            part = self._take(min(n - got, len(self._buf)))
            dest[got : got + len(part)] = part
            got += len(part)

    def payload(self, frame: Frame, dest: np.ndarray | None, sink: Sink | None) -> None:
        """Read ``frame``'s payload into ``dest`` (raw bytes, contiguous) or hand it chunk by chunk to
        ``sink`` (which adds it somewhere); exactly one of the two is given."""
        if frame.nbytes == 0:
            return
        if frame.chunked:
            self._from_ring(frame.nbytes, dest, sink)
        elif dest is not None:
            self._read_into(memoryview(dest))  # type: ignore[arg-type]
        else:
            assert sink is not None
            if self.scratch is None:
                self.scratch = np.empty(TCP_CHUNK, np.uint8)
            for off in range(0, frame.nbytes, TCP_CHUNK):
                m = min(TCP_CHUNK, frame.nbytes - off)
                self._read_into(memoryview(self.scratch[:m]))  # type: ignore[arg-type]
                sink(off, self.scratch[:m])

    def _from_ring(self, nbytes: int, dest: np.ndarray | None, sink: Sink | None) -> None:
        if self.slots is None:
            raise LinkClosed(f"rank {self.peer} sent a shared-memory chunk over a link without a ring")
        off = 0
        while off < nbytes:
            slot, m = CHUNK.unpack(self._take(CHUNK.size))
            if slot >= SLOTS or m > SLOT_BYTES or off + m > nbytes:
                raise LinkClosed(f"rank {self.peer} sent a malformed chunk (slot {slot}, {m} bytes)")
            if dest is not None:
                np.copyto(dest[off : off + m], self.slots[slot, :m])
            else:
                assert sink is not None
                sink(off, self.slots[slot, :m])
            try:
                self.sock.sendall(CREDIT.pack(slot))
            except OSError:
                pass  # the sender may close right after its last chunk; a dead one shows as EOF next read
            off += m

    def close(self) -> None:
        self.sock.close()
        self.slots = None
        if self.ring is not None:
            self.ring.close()


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def new_ring(rank: int, peer: int) -> tuple[int, mmap.mmap]:
    """A fresh anonymous ring (memfd) for the link rank -> peer: its fd (to pass) and this side's map."""
    fd = os.memfd_create(f"sbpflow-ring-{rank}-to-{peer}", os.MFD_CLOEXEC)
    os.ftruncate(fd, SLOTS * SLOT_BYTES)
    return fd, mmap.mmap(fd, SLOTS * SLOT_BYTES)


def map_ring(fd: int) -> mmap.mmap:
    try:
        size = os.fstat(fd).st_size
        if size != SLOTS * SLOT_BYTES:
            raise TransportError(
                f"a peer's shared-memory ring has {size} bytes, this side expects {SLOTS * SLOT_BYTES}: "
                "both ranks must run the same sbpflow version"
            )
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


# -- opening a link ---------------------------------------------------------------------------------

HELLO = struct.Struct("<I")
MAGIC = "sbpflow-cpu/1"


def send_hello(sock: socket.socket, hello: dict[str, Any], fds: list[int]) -> None:
    body = json.dumps({"magic": MAGIC, **hello}).encode()
    data = HELLO.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv_hello(sock: socket.socket, unix: bool) -> tuple[dict[str, Any], list[int]]:
    """The peer's hello (and the ring fd it passed), read under the socket's current timeout."""
    if unix:
        data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    else:
        data, fds = sock.recv(4096), []
    if len(data) < HELLO.size:
        data += _read_n(sock, HELLO.size - len(data))
    (n,) = HELLO.unpack(data[: HELLO.size])
    body = data[HELLO.size :]
    if len(body) < n:
        body += _read_n(sock, n - len(body))
    try:
        hello = json.loads(body)
    except ValueError:
        hello = {}
    if not isinstance(hello, dict) or hello.get("magic") != MAGIC:
        for fd in fds:
            os.close(fd)
        raise LinkClosed(f"not an sbpflow CPU transport peer (expected {MAGIC!r})")
    return hello, list(fds)


def _read_n(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    read_exact(sock, memoryview(buf))
    return bytes(buf)


# -- element types on the wire ----------------------------------------------------------------------


def encode_dtype(dtype: np.dtype[Any]) -> str:
    """numpy's type string ('<f4', '|b1'); bfloat16 (ml_dtypes, a void type to numpy) by name."""
    if dtype.name == "bfloat16":
        return "bfloat16"
    if dtype.kind in "OSUVMm" or dtype.hasobject:  # as base.check_movable: plain numeric arrays only
        raise TransportError(
            f"the CPU transport moves plain numeric arrays; got dtype {dtype}: convert it to one of "
            "float16, float32, float64, int32, int64 or bool"
        )
    return dtype.str


def decode_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        try:
            import ml_dtypes  # type: ignore[import-not-found]
        except ImportError:
            raise LinkClosed("a peer sent bfloat16 but ml_dtypes is not installed here") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
