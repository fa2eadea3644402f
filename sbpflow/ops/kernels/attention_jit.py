"""The attention op's passes over its ``[T, T]`` scores, compiled with numba: attention.py's fast path.

Unfused, the scores of q k^T went through ``mul_scalar``, ``causal_mask`` and ``softmax`` forward and
``softmax_grad``, ``causal_mask`` and ``mul_scalar`` backward: three kernels each way, each reading and
writing the whole ``[B, H, T, T]`` array (numpy's ``copyto`` for the mask, rows_jit's loops for the
softmax). Here each direction is one pass a row, in place on the array the matmul has just written, and a
masked key is never computed: its probability is 0, as exp(-1e30 - max) was.

The operations are the unfused kernels' in their order (scale, then mask, then max, exp by jit_math's
``vexp``, sum, times the sum's reciprocal; backward ``(dp - sum(dp p)) p``, masked, times scale). No
``fastmath`` (rows_jit's FLAGS): a sum adds in 8 running sums (:func:`_dot8`), an order fixed here, so
its last bit may differ from rows_jit's reassociated sums. Compiled with FLAGS the forward pass was no
faster (560 against 410 us on [4096, 64] float32 rows, load ~3.5); it is ~2x rows_jit's softmax alone
(410 against 200 us), its own scale and mask included, the price of the sum's fixed order and of the row
loops LLVM vectorises less well here (measured: an exp loop alone ~140-190 us). Rows are ``[rows, Tk]``:
row ``i`` is query ``q0 + i % tq`` (``q0``: where this rank's query shard starts), and with ``causal`` it
sees keys ``0 .. query``.

Each takes a C-contiguous float32 or float64 array and writes in place; ``tests/sbpflow/ops/kernels/
test_attention_jit.py`` checks them against attention.py's numpy path and PyTorch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from sbpflow.ops.kernels.jit_math import vexp, vmax


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _seen(i: int, n: int, causal: bool, tq: int, q0: int) -> int:  # pragma: no cover - compiled
    """How many keys row ``i`` sees: all ``n``, or with ``causal`` those up to its query index."""
    return min(n, q0 + i % tq + 1) if causal else n


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _dot8(a: Any, b: Any, lim: int) -> Any:  # pragma: no cover - compiled
    """sum(a[:lim] * b[:lim]) in 8 running sums (element j into sum j % 8), added pairwise at the
    end: an order fixed here, which LLVM keeps and vectorises as 8 lanes (one running sum, without
    fastmath, is a chain of dependent adds: the forward pass took 1125 us on the main job's scores, 5.6x
    rows_jit's softmax)."""
    z = a.dtype.type(0)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = z
    full = lim - lim % 8
    for j in range(0, full, 8):
        s0 += a[j] * b[j]
        s1 += a[j + 1] * b[j + 1]
        s2 += a[j + 2] * b[j + 2]
        s3 += a[j + 3] * b[j + 3]
        s4 += a[j + 4] * b[j + 4]
        s5 += a[j + 5] * b[j + 5]
        s6 += a[j + 6] * b[j + 6]
        s7 += a[j + 7] * b[j + 7]
    t = z
    for j in range(full, lim):
        t += a[j] * b[j]
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + t


@njit(cache=True, nogil=True, error_model="numpy")
def softmax_scores(s: Any, scale: float, causal: bool, tq: int, q0: int) -> None:  # pragma: no cover
    """s = softmax(mask(s * scale)) along each row, in place: the attention probabilities.

    One sweep of the rows per step (scale and max, exp, sum, times the sum's reciprocal), each row's
    maximum and then reciprocal kept between sweeps: a row at a time, the four loops of different
    lengths a causal row has took 1.6x as long (430 against 270 us on the main job's [4096, 64] float32
    scores, CPU time, load ~2.5), the same operations in the same order, so the same bits."""
    rows, n = s.shape
    c = s.dtype.type(scale)
    zero, one = s.dtype.type(0), s.dtype.type(1)
    ones = np.ones(n, s.dtype)  # a row's sum is its dot product with these (times 1 is exact)
    kept = np.empty(rows, s.dtype)  # each row's maximum, then its sum's reciprocal
    for i in range(rows):
        r = s[i]  # a row view: indexed [i, j], the loops ran 3x slower (not vectorised)
        m = r[0] * c
        for j in range(_seen(i, n, causal, tq, q0)):
            x = r[j] * c
            r[j] = x
            m = vmax(m, x)  # type: ignore[call-arg]
        kept[i] = m
    for i in range(rows):
        r, m = s[i], kept[i]
        for j in range(_seen(i, n, causal, tq, q0)):
            r[j] = vexp(r[j] - m)  # type: ignore[call-arg]
    for i in range(rows):
        # times the reciprocal, as rows_jit's softmax compiles its division (arcp): half a division's time
        kept[i] = one / _dot8(s[i], ones, _seen(i, n, causal, tq, q0))
    for i in range(rows):
        r, inv, lim = s[i], kept[i], _seen(i, n, causal, tq, q0)
        for j in range(lim):
            r[j] = r[j] * inv
        for j in range(lim, n):
            r[j] = zero


@njit(cache=True, nogil=True, error_model="numpy")
def softmax_scores_grad(
    p: Any, dp: Any, scale: float, causal: bool, tq: int, q0: int
) -> None:  # pragma: no cover
    """dp = mask((dp - sum(dp p)) p) * scale along each row, in place: the scores' gradient from the
    probabilities' (``p`` is 0 on masked keys, so the sum skips them)."""
    rows, n = p.shape
    c = p.dtype.type(scale)
    zero = p.dtype.type(0)
    for i in range(rows):
        pr, dr = p[i], dp[i]
        lim = _seen(i, n, causal, tq, q0)
        t = _dot8(dr, pr, lim)
        for j in range(lim):
            dr[j] = ((dr[j] - t) * pr[j]) * c
        for j in range(lim, n):
            dr[j] = zero
