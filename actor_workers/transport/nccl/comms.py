"""The NCCL transport's communicators: how each is made, named and ordered against the caller's stream.

- **Bootstrap.** Rank 0 calls ``NcclTransport.unique_id`` and the control plane ships the 128 bytes to
  every rank: that id makes the world communicator (``ranks`` in the given order; NCCL rank = position).
  ncclCommSplit is not in cupy, so every other communicator is made from its own id, asked of
  ``uid_for(key)`` with a :class:`CommKey` (``collective:0,2`` for a group in call order, ``p2p:0->2`` for
  the messages from rank 0 to rank 2). ``uid_for`` must return the same id to every member of ``key``.
  Communicators are made lazily, on a key's first call, and creation waits at most ``timeout``.
- **Streams.** Each communicator has its own CUDA stream. Work is ordered with events
  (:mod:`sbpflow.actor_workers.runtime.cuda_streams`): the comm stream waits for an event recorded on the caller's current
  stream (the inputs are ready), runs the NCCL call and its copies, and an event recorded after it says
  the result is ready. On a worker with a compute stream (:meth:`NcclComms.use_compute_stream`) only the
  acts that read the result wait for that event; otherwise the caller's stream waits at once. The host
  does not wait for the data, so compute and communication overlap. One stream per communicator, not one for
  all: the plan orders the calls of each communicator, not the calls of different ones, and a shared
  stream would serialise two groups in an order their other members need not follow (a hang).
- **Waiting.** The host waits only for small things (a header, work in flight at close), with
  ``timeout``; a timeout aborts the transport (a hung NCCL call never returns).

:class:`NcclComms` is the base of ``NcclTransport``: this rank's communicators and the stream discipline.
cupy is imported only when one is constructed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sbpflow.actor_workers.runtime.cuda_streams import ComputeStream, launch_on, record
from sbpflow.actor_workers.transport.base import TransportAborted, TransportError
from sbpflow.device import INSTALL_HINT

UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def import_nccl() -> Any:
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


@dataclass(eq=False)
class Comm:
    """One communicator of this rank: the NCCL handle, its stream, this rank's position, work in flight."""

    key: CommKey
    handle: Any  # cupy.cuda.nccl.NcclCommunicator
    stream: Any  # cupy.cuda.Stream
    pos: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    inflight: deque[tuple[Any, tuple[Any, ...]]] = field(default_factory=deque)  # (done event, kept arrays)


class NcclComms:
    """This rank's NCCL communicators, made on first use, and the stream discipline of every call on them.

    The transport on top (``NcclTransport``) checks its arguments, then calls this ``__init__``, which
    needs cupy with NCCL (a TransportError with the install hint otherwise).
    """

    def __init__(
        self,
        rank: int,
        world: tuple[int, ...],
        uid: bytes,
        device: int | None,
        uid_for: UidFor | None,
        timeout: float,
    ) -> None:
        self.nccl = import_nccl()
        import cupy

        self.cp: Any = cupy
        self.rank, self.world, self.uid = rank, world, bytes(uid)
        self.device = int(cupy.cuda.Device().id if device is None else device)
        self.uid_for, self.timeout = uid_for, float(timeout)
        self.abort_reason: str | None = None
        self._lock = threading.Lock()
        self._making: dict[CommKey, threading.Lock] = {}
        self._comms: dict[CommKey, Comm] = {}
        self.compute: ComputeStream | None = None  # the worker's (use_compute_stream); None: wait at once

    # -- abort and teardown ---------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Abort every communicator of this rank (ncclCommAbort ends its kernels), so that every blocked and
        later call raises ``TransportAborted(reason)``; only the first abort counts, and :meth:`_aborted`
        then lets the transport on top wake its own waits and tell the other ranks."""
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
        self._aborted(reason)

    def _aborted(self, reason: str) -> None:
        """Called once, after the first abort has aborted the communicators."""

    def _destroy_comms(self) -> None:
        """Wait for each communicator's work in flight (unless aborted: it never ends), then destroy it."""
        with self._lock:
            comms, self._comms = list(self._comms.values()), {}
        with self.cp.cuda.Device(self.device):
            for comm in comms:
                if self.abort_reason is None:
                    try:
                        self._wait(record(self.cp.cuda, comm.stream), comm, "close (work in flight)")
                    except TransportError:
                        continue  # _wait aborted every communicator
                comm.handle.destroy()

    # -- the stream discipline ------------------------------------------------------------------------

    def run(
        self,
        comm: Comm,
        body: Callable[[], Any],
        inputs: tuple[Any, ...] = (),
        keep: Sequence[Any] = (),
        ready: Any = None,
        wait: bool = True,
    ) -> tuple[Any, Any]:
        """Run ``body()`` (its NCCL calls and cupy work) on ``comm``'s stream after ``ready`` (default: the
        caller's stream's work so far) and after ``inputs`` still being made on other streams; order its
        result before the caller's readers (unless ``wait`` is false: nothing on the caller's side reads a
        send), at once or through the worker's compute stream (:func:`sbpflow.actor_workers.runtime.cuda_streams.launch_on`); keep
        ``inputs`` and ``keep`` alive until it is done. Returns the result and its done event."""
        result, done = launch_on(self.cp.cuda, comm.stream, body, inputs, ready, self.compute, wait)
        while comm.inflight and comm.inflight[0][0].done:
            comm.inflight.popleft()
        comm.inflight.append((done, (*inputs, *keep)))
        return result, done

    def use_compute_stream(self, compute: ComputeStream | None) -> None:
        """Hand results over to ``compute``'s readers instead of making the caller's stream wait at once."""
        self.compute = compute

    def _wait(self, event: Any, comm: Comm, what: str) -> None:
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

    def _comm(self, key: CommKey) -> Comm:
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

    def _create(self, key: CommKey) -> Comm:
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
        return Comm(key, box["handle"], stream, pos)

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
