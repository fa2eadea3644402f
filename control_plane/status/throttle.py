"""Failed-authentication rate limit per peer, shared by the HTTP status endpoint and gRPC (``auth.py``).

A peer (an IP address: the port changes with every connection) that sends ``failures`` wrong tokens
within ``window`` seconds is refused outright — HTTP 429 / gRPC RESOURCE_EXHAUSTED, with the seconds to
wait — until that window has passed, whatever it sends, the right token included: a locked peer's
guesses are never compared, so they tell it nothing. Other peers are untouched. Without a limit a
wrong token cost the server ~0.7 ms, ~1,500 guesses a second from one client.

Memory is bounded: the table keeps the ``peers`` most recently failing peers (an LRU); a peer pushed
out starts a fresh count, which only an attacker spreading over more than ``peers`` addresses gains
from — and each address still gets only ``failures`` guesses a window.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FailureLimit:
    failures: int = 20  # wrong tokens a peer may send in a window
    window: float = 60.0  # seconds, from the peer's first failure in it
    peers: int = 4096  # peers remembered (LRU): ~100 B each


DEFAULT_LIMIT = FailureLimit()


@dataclass
class _Count:
    start: float
    failures: int


class Throttle:
    """``wait(peer)``: seconds the peer must wait (0 when it may try); ``failed(peer)`` counts a wrong token."""

    def __init__(self, limit: FailureLimit = DEFAULT_LIMIT, clock: Callable[[], float] = time.monotonic):
        self.limit, self._clock = limit, clock
        self._peers: OrderedDict[str, _Count] = OrderedDict()
        self._lock = threading.Lock()  # gRPC handlers and the HTTP executor call from many threads

    def wait(self, peer: str) -> float:
        with self._lock:
            count = self._peers.get(peer)
            if count is None:
                return 0.0
            left = count.start + self.limit.window - self._clock()
            if left <= 0:
                del self._peers[peer]
                return 0.0
            return left if count.failures >= self.limit.failures else 0.0

    def failed(self, peer: str) -> None:
        with self._lock:
            now = self._clock()
            count = self._peers.pop(peer, None)
            if count is None or count.start + self.limit.window <= now:
                count = _Count(now, 0)
            count.failures += 1
            self._peers[peer] = count  # most recent last
            while len(self._peers) > self.limit.peers:
                self._peers.popitem(last=False)


def retry_after(seconds: float) -> str:
    """The ``Retry-After`` value: whole seconds, rounded up."""
    return str(max(1, math.ceil(seconds)))


def peer_host(peer: str) -> str:
    """The address of a gRPC peer (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``) without its port."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:].partition("]")[0]
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer  # unix sockets and the like: the whole name
