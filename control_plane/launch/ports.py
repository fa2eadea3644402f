"""Ports the control plane's gRPC servers bind (JobService, the report hub's WorkerService).

gRPC binds with ``SO_REUSEPORT`` by default: a second server on a port in use starts and takes part of
the first one's connections. Every server here binds with it off (:data:`NOT_SHARED`), so a port in use
is an error. And for port 0 on a name of several addresses (``localhost``: 127.0.0.1 and ::1) gRPC
takes the first address's port for the others; where another process (a Ray worker's gRPC server)
holds it on one, gRPC logs a line and serves on the other alone, and that process gets those clients.
:func:`free_port` picks a port free on every address instead.
"""

from __future__ import annotations

import socket

from sbpflow.errors import SbpflowError

NOT_SHARED = ("grpc.so_reuseport", 0)  # a gRPC server option: a port in use is an error, never shared


def free_port(host: str, port: int, tries: int = 50) -> int:
    """The port to bind on ``host``: ``port`` itself unless 0; for 0 a port free on every address the
    host resolves to (one address: 0, the kernel picks)."""
    if port:
        return port
    try:
        found = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
    except OSError:
        return 0  # gRPC names the host it cannot resolve
    addresses = list(dict.fromkeys((int(family), str(sockaddr[0])) for family, _, _, _, sockaddr in found))
    if len(addresses) < 2:
        return 0
    return free_on_all(addresses, tries) or _no_port(host, tries)


def free_on_all(addresses: list[tuple[int, str]], tries: int = 50) -> int:
    """A port free on every (family, address) now; 0 if none was found in ``tries`` tries."""
    for _ in range(tries):
        held: list[socket.socket] = []
        try:
            for family, address in addresses:
                s = socket.socket(family, socket.SOCK_STREAM)
                held.append(s)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind((address, held[0].getsockname()[1] if len(held) > 1 else 0))
            return int(held[0].getsockname()[1])
        except OSError:
            continue  # taken on a later address: another port
        finally:
            for s in held:
                s.close()
    return 0


def _no_port(host: str, tries: int) -> int:
    raise SbpflowError(f"no port free on every address of {host!r} in {tries} tries; give --port")
