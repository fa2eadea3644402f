"""Reused result buffers: a large array the transport hands out comes back once nobody holds it.

A transport's results never alias its inputs, and the caller may keep and mutate them, so every result
is a new array — and a new large array is fresh memory the kernel must fault in page by page (a 64 MB
result costs about as much in page faults as copying it). A :class:`BufferPool` keeps the flat byte
buffers behind large results and hands one out again once the only reference left is the pool's own:
CPython counts references exactly, and every view of a result (a reshape, a slice, ``np.asarray``)
holds a reference to the buffer it views, so a buffer nobody can reach is one nobody can read.

Small arrays (below ``min_bytes``) are not pooled: numpy's allocator already reuses them cheaply. The
pool keeps at most ``max_bytes`` of idle buffers, dropping the oldest first.
"""

from __future__ import annotations

import sys
import threading
from math import prod
from typing import Any

import numpy as np

MIN_BYTES = 1 << 20
MAX_BYTES = 1 << 30
_HELD_BY_POOL_ONLY = 2  # the pool's list, and getrefcount's own argument


class BufferPool:
    def __init__(self, min_bytes: int = MIN_BYTES, max_bytes: int = MAX_BYTES) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0  # how many results came from an idle buffer (for tests and benchmarks)

    def empty(self, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array, from an idle buffer of exactly its size when there is one."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(shape, dtype)
        with self._lock:
            buffer = self._idle(nbytes)
            if buffer is None:
                buffer = np.empty(nbytes, np.uint8)
                self._buffers.append(buffer)
                self._trim()
            else:
                self.reused += 1
        return buffer.view(dtype).reshape(shape)

    def _idle(self, nbytes: int) -> np.ndarray | None:
        for i in range(len(self._buffers)):
            if self._buffers[i].nbytes == nbytes and sys.getrefcount(self._buffers[i]) == _HELD_BY_POOL_ONLY:
                buffer = self._buffers.pop(i)
                self._buffers.append(buffer)  # most recently used last
                return buffer
        return None

    def _trim(self) -> None:
        """Drop the oldest idle buffers while the idle ones exceed ``max_bytes``."""
        idle = [
            i for i in range(len(self._buffers)) if sys.getrefcount(self._buffers[i]) == _HELD_BY_POOL_ONLY
        ]
        total = sum(self._buffers[i].nbytes for i in idle)
        for i in sorted(idle):
            if total <= self.max_bytes:
                break
            total -= self._buffers[i].nbytes
            self._buffers[i] = _DROPPED
        self._buffers = [b for b in self._buffers if b is not _DROPPED]

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


_DROPPED = np.empty(0, np.uint8)
