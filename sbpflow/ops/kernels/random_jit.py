"""random.py's Philox4x32-10 as numba loops for numpy arrays: fused with dropout's scaling
(``dropout_rows``), and the four words at given offsets (``words_at``: every numpy draw of random.py).

numpy runs each of Philox's ten rounds as ~12 whole-array passes (widen, multiply, shift, mask, narrow,
xor), ~60 us a 1000 elements; this loop keeps an element's four words in registers through the rounds
and writes ``x * keep / (1 - rate)`` at once. It computes exactly random.py's counter layout, rounds and
keep test on the raw word, so its mask is bit for bit the numpy generator's, which stays the reference
and cupy's path (``tests/sbpflow/test_random.py`` compares the two on several keys, shards and shapes).

It releases the GIL (``nogil``), as numpy's loops do. Every operand is a uint32 or uint64 numpy scalar: numba types a uint64 mixed with a Python int as
float64, which would lose the words' low bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_LOW = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


@njit(cache=True, nogil=True, inline="always")
def _philox(off: Any, step: Any, tid: Any, keys: Any) -> Any:  # pragma: no cover - compiled
    """The four Philox words of the element at global offset ``off``: counter (offset lo, offset hi,
    step, tid), round keys ``keys`` [10, 2] (random.philox4x32's schedule)."""
    c0, c1, c2, c3 = np.uint32(off & _LOW), np.uint32(off >> _32), step, tid
    for k in range(10):
        p0 = np.uint64(c0) * _M0
        p1 = np.uint64(c2) * _M1
        c0, c1, c2, c3 = (
            np.uint32(p1 >> _32) ^ c1 ^ keys[k, 0],
            np.uint32(p1 & _LOW),
            np.uint32(p0 >> _32) ^ c3 ^ keys[k, 1],
            np.uint32(p0 & _LOW),
        )
    return c0, c1, c2, c3


@njit(cache=True, nogil=True, error_model="numpy")
def dropout_rows(
    x: Any, bases: Any, step: Any, tid: Any, keys: Any, threshold: Any, scale: Any, out: Any
) -> None:  # pragma: no cover - compiled
    """out[r, j] = x[r, j] * (scale if w0 < threshold else 0), w0 the first Philox word of the element
    at global offset bases[r] + j, counter (offset lo, offset hi, step, tid), round keys ``keys`` [10, 2]
    (random.philox4x32's schedule). x and out are [rows, n] C-contiguous of one float dtype."""
    rows, n = x.shape
    zero = x.dtype.type(0)
    for r in range(rows):
        base = bases[r]
        for j in range(n):
            w0 = _philox(base + np.uint64(j), step, tid, keys)[0]
            out[r, j] = x[r, j] * (scale if np.uint64(w0) < threshold else zero)


@njit(cache=True, nogil=True, error_model="numpy")
def words_at(offsets: Any, step: Any, tid: Any, keys: Any, w0: Any, w1: Any, w2: Any, w3: Any) -> None:
    """w0..w3[i] = the four Philox words of the element at global offset offsets[i] (uint64, flat),
    counter (offset lo, offset hi, step, tid), round keys ``keys`` [10, 2]: random.words_at's, bit for
    bit, in one pass where numpy makes ~60 (a data source's read of a few hundred draws)."""
    for i in range(offsets.size):
        w0[i], w1[i], w2[i], w3[i] = _philox(offsets[i], step, tid, keys)
