"""One NCCL unique id per communicator key, made by exactly one member.

``ncclGetUniqueId`` starts a bootstrap root that listens until the communicator is made, so an id made
and then discarded (two members racing to file one) leaves a listener behind. :class:`UidBook` is the
control plane's store of a job attempt: the first member to :meth:`~UidBook.ask` for a key is told to
make the id, every other one is told to come back until it is filed; :func:`fetch_uid` is a member's
side of that, and calls ``make`` at most once, only when it is the maker and the key has no id yet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sbpflow.actor_workers.transport.base import TransportError

Ask = Callable[[str, int], tuple[bytes, bool]]  # (key, member) -> (the id or b"", whether to make it)
File = Callable[[str, bytes], bytes]  # (key, id) -> the id now filed under key


class UidBook:
    """Unique ids by communicator name, and who was asked to make each one that is not filed yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, bytes] = {}
        self._makers: dict[str, int] = {}

    def ask(self, key: str, member: int) -> tuple[bytes, bool]:
        """The id of ``key`` if filed; else whether ``member`` makes it (the first to ask does)."""
        with self._lock:
            found = self._ids.get(key)
            if found is not None:
                return found, False
            maker = self._makers.setdefault(key, member)
            return b"", maker == member

    def file(self, key: str, uid: bytes) -> bytes:
        """File the maker's id of ``key``; the first one filed stays."""
        with self._lock:
            return self._ids.setdefault(key, bytes(uid))

    def made(self) -> int:
        """How many ids are filed."""
        with self._lock:
            return len(self._ids)


def fetch_uid(
    ask: Ask, file: File, key: str, member: int, make: Callable[[], bytes], timeout: float
) -> bytes:
    """The id of ``key`` for ``member``: filed already, made here (once) if this member is the maker, or
    waited for (at most ``timeout`` seconds) while the maker makes it."""
    deadline, pause = time.monotonic() + timeout, 1e-3
    while True:
        uid, mine = ask(key, member)
        if uid:
            return uid
        if mine:
            return file(key, make())
        if time.monotonic() > deadline:
            raise TransportError(
                f"member {member} waited {timeout:g} s for the NCCL unique id of {key}, which the member asked "
                "to make it never filed; that member failed or is stuck before its first call on the communicator"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
