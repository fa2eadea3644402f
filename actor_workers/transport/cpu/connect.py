"""Connection set-up of the CPU transport: the endpoint a rank publishes, listening, dialing, accepting.

A rank listens from construction on (:class:`Listener`): on TCP, and with shared memory also on an
abstract unix socket (no file on disk). A rank dials every peer once (:func:`dial`): over the unix socket
when both ranks publish the same ``host_id`` and the socket is reachable (another network namespace
falls back to TCP), else over TCP. The dialer's hello names both ranks and, on one host, passes the memfd
ring of the link; the listener checks it (right rank, not already connected, ring present when promised)
and answers ok or why not before the link carries frames. The accepted link goes to the transport's
``on_link`` callback, which starts its receive thread. The frames themselves are in :mod:`cpu_links`.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sbpflow.actor_workers.transport.base import TransportError
from sbpflow.actor_workers.transport.cpu.links import (
    InLink,
    LinkClosed,
    OutLink,
    map_ring,
    new_ring,
    recv_hello,
    send_hello,
    set_send_timeout,
)

ACCEPT_POLL_S = 0.05  # how often the accept thread looks whether it should stop


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


def dial(own: Endpoint, e: Endpoint, shared_memory: bool, deadline: float, timeout: float) -> OutLink:
    """Open the one-way link from the rank published as ``own`` to ``e`` and do the handshake;
    ``timeout`` bounds each later send on the link."""
    same_host = shared_memory and bool(e.uds) and e.host_id == own.host_id
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
    rank, ring = own.rank, None
    try:
        hello = {"rank": rank, "to": e.rank, "shm": same_host}
        if same_host:
            fd, ring = new_ring(rank, e.rank)
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
        set_send_timeout(sock, timeout)
    except BaseException:
        sock.close()
        if ring is not None:
            ring.close()
        raise
    return OutLink(e.rank, sock, ring, timeout)


def admit(
    sock: socket.socket, unix: bool, rank: int, timeout: float, connected: Callable[[int], bool]
) -> InLink:
    """Check the hello on an accepted ``sock`` for rank ``rank`` and answer it; the link on success,
    :class:`LinkClosed` (after telling the dialer why) when the hello is wrong."""
    sock.settimeout(timeout)
    if not unix:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hello, fds = recv_hello(sock, unix)
    ring = map_ring(fds[0]) if fds else None
    peer, problem = hello.get("rank"), None
    if hello.get("to") != rank:
        problem = f"it dialled rank {hello.get('to')}, this is rank {rank}"
    elif not isinstance(peer, int) or connected(peer):
        problem = f"rank {peer} is already connected"
    elif bool(hello.get("shm")) != (ring is not None):
        problem = "a shared-memory link came without its ring"
    if problem is not None:
        send_hello(sock, {"rank": rank, "ok": False, "error": problem}, [])
        if ring is not None:
            ring.close()
        raise LinkClosed(problem)
    assert isinstance(peer, int)
    send_hello(sock, {"rank": rank, "ok": True}, [])
    sock.settimeout(None)
    set_send_timeout(sock, timeout)
    return InLink(peer, sock, ring)


class Listener:
    """A rank's listening sockets and the thread that admits its peers' links until :meth:`stop`.

    ``connected(peer)`` says whether ``peer`` already has a link in; ``on_link`` takes each new one.
    """

    def __init__(
        self,
        rank: int,
        host: str,
        host_id: str,
        shared_memory: bool,
        timeout: float,
        connected: Callable[[int], bool],
        on_link: Callable[[InLink], None],
    ) -> None:
        self.rank, self.timeout = rank, timeout
        self._connected, self._on_link = connected, on_link
        self._tcp = socket.create_server((host, 0), backlog=1024)
        self._unix: socket.socket | None = None
        uds = ""
        if shared_memory:
            uds = f"@sbpflow-{rank}-{uuid.uuid4().hex[:16]}"
            self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._unix.bind("\0" + uds[1:])
            self._unix.listen(1024)
        self.endpoint = Endpoint(rank, host, self._tcp.getsockname()[1], host_id, uds)
        self._accepting = True
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"sbpflow-cpu-accept-{rank}", daemon=True
        )
        self._acceptor.start()

    def _accept_loop(self) -> None:
        listeners = [s for s in (self._tcp, self._unix) if s is not None]
        while self._accepting:
            readable, _, _ = select.select(listeners, [], [], ACCEPT_POLL_S)
            for lst in readable:
                try:
                    sock, _ = lst.accept()
                except OSError:
                    continue
                try:
                    link = admit(sock, lst is self._unix, self.rank, self.timeout, self._connected)
                    self._on_link(link)
                except (OSError, LinkClosed, TransportError, ValueError):
                    sock.close()

    def stop(self) -> None:
        """Stop admitting links (from the accept thread itself too); the sockets stay open."""
        self._accepting = False
        if self._acceptor.is_alive() and self._acceptor is not threading.current_thread():
            self._acceptor.join()

    def close(self) -> None:
        """Stop, then close the listening sockets."""
        self.stop()
        for s in (self._tcp, self._unix):
            if s is not None:
                s.close()
