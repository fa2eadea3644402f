"""BufferPool: a large result's buffer comes back only once nothing can reach it."""

from __future__ import annotations

import numpy as np

from sbpflow.actor_workers.transport.pool import BufferPool

MB = 1 << 20


def test_a_dropped_result_is_reused_for_the_next_of_its_size() -> None:
    pool = BufferPool()
    a = pool.empty((MB // 4,), np.float32)
    address = a.ctypes.data
    del a
    b = pool.empty((512, MB // 2048), np.float32)  # same bytes, another shape
    assert pool.reused == 1 and b.ctypes.data == address and b.flags.c_contiguous


def test_a_buffer_anyone_still_reaches_is_never_handed_out_again() -> None:
    pool = BufferPool()
    a = pool.empty((MB,), np.uint8)
    view = a[10:].reshape(-1)  # a view keeps the buffer alive
    del a
    b = pool.empty((MB,), np.uint8)
    assert pool.reused == 0 and not np.shares_memory(b, view)
    kept = np.asarray(b)
    del b
    c = pool.empty((MB,), np.uint8)
    assert pool.reused == 0 and not np.shares_memory(c, kept)


def test_small_arrays_are_not_pooled_and_idle_bytes_are_bounded() -> None:
    pool = BufferPool(max_bytes=3 * MB)
    small = pool.empty((100,), np.float64)
    assert small.base is None
    for n in range(1, 6):  # idle buffers of 1..5 MB, each dropped by its caller at once
        pool.empty((n * MB,), np.uint8)
    # the oldest idle ones go whenever the idle bytes pass 3 MB (the one being handed out is not idle)
    assert [b.nbytes for b in pool._buffers] == [5 * MB]
