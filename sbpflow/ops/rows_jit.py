"""One pass a row: nn.py's softmax, layer norm and cross entropy kernels compiled with numba, for numpy.

numpy makes each of these ops 4-8 calls (a reduction, a broadcast, an elementwise op, ...), and each
pass over a row of 64 pays its per-row setup; PyTorch makes one fused pass. These loops make one pass a
row, or two around numpy's ``exp``: numpy's float32 ``exp`` is vectorised, numba's is a scalar call
(no SVML in the wheels), so every kernel that exponentiates leaves the ``exp`` to numpy.

They are the fast path only. Every one computes the formula of its numpy kernel in nn.py, which stays
the reference and the kernel for cupy and for arrays these do not take (see ``rowwise.jit_rows``);
``tests/sbpflow/ops/test_rows_jit.py`` checks each against it. The flags let LLVM reassociate the row
sums (so it vectorises them: a sum's last bits differ from numpy's, and a row's result depends on that
row alone, so a shard's rows match the whole tensor's) but keep nan and inf semantics: a masked score
is -inf. Compiled on first use and cached beside this file (``cache=True``).

Each takes 2-d C-contiguous arrays ``[rows, n]`` of one float dtype and writes its outputs in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

# reassociate, contract to fma, reciprocal, no signed zeros; not nnan/ninf: -inf scores are data
_FLAGS = {"reassoc", "contract", "arcp", "nsz"}


@njit(cache=True, fastmath=_FLAGS | {"nnan"}, inline="always")
def _row_max(x: Any, i: int) -> Any:  # pragma: no cover - compiled
    """Row ``i``'s maximum, vectorised: LLVM reduces a maximum in vector lanes only under no-nans. A row
    that holds a nan gets some value of the row here, and its softmax or loss is nan all the same (the nan
    element's exp is nan, so is the row's sum), as numpy's; tests/sbpflow/ops/test_rows_jit.py checks."""
    m = x[i, 0]
    for j in range(1, x.shape[1]):
        v = x[i, j]
        if v > m:
            m = v
    return m


@njit(cache=True, fastmath=_FLAGS)
def shift_rows(x: Any, out: Any, maxima: Any) -> None:  # pragma: no cover - compiled
    """out = x - max(x) along each row, and maxima[i] = row i's max(x)."""
    rows, n = x.shape
    for i in range(rows):
        m = _row_max(x, i)
        maxima[i] = m
        for j in range(n):
            out[i, j] = x[i, j] - m


@njit(cache=True, fastmath=_FLAGS)
def normalize_rows(e: Any) -> None:  # pragma: no cover - compiled
    """e /= sum(e) along each row (softmax's last step, after the exp)."""
    rows, n = e.shape
    for i in range(rows):
        s = e.dtype.type(0)
        for j in range(n):
            s += e[i, j]
        for j in range(n):
            e[i, j] = e[i, j] / s


@njit(cache=True, fastmath=_FLAGS)
def softmax_grad_rows(y: Any, dy: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = y (dy - sum(dy y)) along each row."""
    rows, n = y.shape
    for i in range(rows):
        s = y.dtype.type(0)
        for j in range(n):
            s += dy[i, j] * y[i, j]
        for j in range(n):
            out[i, j] = (dy[i, j] - s) * y[i, j]


@njit(cache=True, fastmath=_FLAGS, inline="always")
def _row_stats(x: Any, i: int, eps: Any) -> tuple[Any, Any]:  # pragma: no cover - compiled
    """Row ``i``'s mean and 1 / sqrt(biased variance + eps), the variance from the centred values."""
    n = x.shape[1]
    s = x.dtype.type(0)
    for j in range(n):
        s += x[i, j]
    mean = s / n
    v = x.dtype.type(0)
    for j in range(n):
        d = x[i, j] - mean
        v += d * d
    return mean, 1 / np.sqrt(v / n + eps)


@njit(cache=True, fastmath=_FLAGS)
def layer_norm_rows(x: Any, w: Any, b: Any, eps: float, out: Any) -> None:  # pragma: no cover - compiled
    """out = (x - mean) rstd w + b along each row."""
    rows, n = x.shape
    e = x.dtype.type(eps)
    for i in range(rows):
        mean, rstd = _row_stats(x, i, e)
        for j in range(n):
            out[i, j] = (x[i, j] - mean) * rstd * w[j] + b[j]


@njit(cache=True, fastmath=_FLAGS)
def layer_norm_grad_rows(
    dy: Any, x: Any, w: Any, eps: float, dx: Any, dw: Any, db: Any
) -> None:  # pragma: no cover - compiled
    """dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w; dw = sum(dy xhat), db = sum(dy) over
    the rows (written, not added to)."""
    rows, n = x.shape
    e = x.dtype.type(eps)
    dw[:] = 0
    db[:] = 0
    for i in range(rows):
        mean, rstd = _row_stats(x, i, e)
        sg = x.dtype.type(0)
        sgx = x.dtype.type(0)
        for j in range(n):
            xhat = (x[i, j] - mean) * rstd
            g = dy[i, j] * w[j]
            sg += g
            sgx += g * xhat
            dw[j] += dy[i, j] * xhat
            db[j] += dy[i, j]
        sg = sg / n
        sgx = sgx / n
        for j in range(n):
            xhat = (x[i, j] - mean) * rstd
            dx[i, j] = (dy[i, j] * w[j] - sg - xhat * sgx) * rstd


@njit(cache=True, fastmath=_FLAGS)
def cross_entropy_rows(
    x: Any, e: Any, maxima: Any, labels: Any, ignore: int, loss: Any
) -> bool:  # pragma: no cover - compiled
    """loss = max x + log(sum(e)) - x[label] per row, 0 where label == ignore; ``e`` holds exp(x - max x)
    and ``maxima`` max x (shift_rows, then numpy's exp). False, at the first label neither ``ignore`` nor in -n..n-1 (the
    caller runs the numpy kernel, which raises numpy's IndexError for it)."""
    rows, n = x.shape
    for i in range(rows):
        lab = labels[i]
        if lab == ignore:
            loss[i] = 0
            continue
        if lab < 0:
            lab += n  # numpy's take_along_axis counts a negative label from the end
        if not 0 <= lab < n:
            return False
        s = e.dtype.type(0)
        for j in range(n):
            s += e[i, j]
        loss[i] = maxima[i] + np.log(s) - x[i, lab]
    return True


@njit(cache=True, fastmath=_FLAGS)
def cross_entropy_grad_rows(e: Any, labels: Any, dy: Any, ignore: int) -> None:  # pragma: no cover
    """e = e dy / sum(e) - onehot(label) dy per row (dy taken as 0 where label == ignore); ``e`` holds
    exp(logits - max) on entry. A label outside 0..V-1 subtracts nothing."""
    rows, n = e.shape
    for i in range(rows):
        lab = labels[i]
        d = e.dtype.type(0) if lab == ignore else dy[i]
        s = e.dtype.type(0)
        for j in range(n):
            s += e[i, j]
        scale = d / s
        for j in range(n):
            e[i, j] = e[i, j] * scale
        if 0 <= lab < n and lab != ignore:
            e[i, lab] = e[i, lab] - d
