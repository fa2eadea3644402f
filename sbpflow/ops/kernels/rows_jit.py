"""One pass a row: nn.py's softmax, layer norm and cross entropy kernels, and the row loops of
reduction.py, shape.py and vocab.py, compiled with numba, for numpy.

numpy makes each of these ops 4-8 calls (a reduction, a broadcast, an elementwise op, ...), and each
pass over a row of 64 pays its per-row setup; PyTorch makes one fused pass. These loops make one pass a
row over what the row needs, with jit_math's ``vexp`` and ``vmax``, an exp and a running maximum that
vectorise inside them.

They are the fast path only. Every one computes the formula of its numpy kernel (in nn.py, or the
module named below), which stays the reference and the kernel for cupy and for arrays these do not take
(see ``rowwise.jit_rows``); ``tests/sbpflow/ops/kernels/test_rows_jit.py`` checks each against it. The flags let
LLVM reassociate the row sums (so it vectorises them: a sum's last bits differ from numpy's, and a row's
result depends on that row alone, so a shard's rows match the whole tensor's) but keep nan and inf
semantics: a masked score is -inf. ``error_model="numpy"``: a division by zero gives inf or nan, as
numpy's, not a check an element that keeps a loop from vectorising (it made sigmoid 30x slower).
Compiled on first use and cached beside this file (``cache=True``). The loops release the GIL
(``nogil``, ~0.05 us a call), as numpy's ufunc loops do, so the runtime's other threads (its
communication stream, in-process ranks) run while one computes.

Each takes C-contiguous arrays of one float dtype (2-d ``[rows, n]`` unless it says otherwise; ids and
labels are int32/int64) and writes its outputs in place. ``take_rows`` is embedding's gather of rows
(shape.py) and ``add_rows_at`` embedding_grad's scatter-add of them, ~10x numpy's sort and reduceat;
``sum_rows``, ``sum_all`` and ``max_rows`` are reduction.py's sum_to of a bias gradient, its sum of a
whole array and its max along the last axis; ``concat_rows`` is shape.py's concat; ``vocab_loss_rows``
and ``vocab_loss_grad_rows`` are vocab.py's loss from its per-row statistics. The elementwise loops on
flat arrays (sigmoid, exp, log, GELU) are elementwise_jit.py's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from sbpflow.ops.kernels.jit_math import FLAGS as _FLAGS
from sbpflow.ops.kernels.jit_math import vexp, vmax


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, inline="always")
def _row_maxima(x: Any) -> Any:  # pragma: no cover - compiled
    """Every row's maximum, in a loop of its own: fused into the loop of a row's exponentials LLVM
    vectorises the two less well (45 against 30 us on [1024, 128] float32)."""
    rows, n = x.shape
    maxima = np.empty(rows, x.dtype)
    for i in range(rows):
        m = x[i, 0]
        for j in range(1, n):
            m = vmax(m, x[i, j])  # type: ignore[call-arg]
        maxima[i] = m
    return maxima


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, inline="always")
def _sum_exp(x: Any, i: int, m: Any) -> Any:  # pragma: no cover - compiled
    """sum(exp(x[i] - m))."""
    t = x.dtype.type(0)
    for j in range(x.shape[1]):
        t += vexp(x[i, j] - m)
    return t


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, inline="always")
def _store_exp(x: Any, i: int, m: Any, out: Any) -> Any:  # pragma: no cover - compiled
    """out[i] = exp(x[i] - m), and its sum."""
    t = x.dtype.type(0)
    for j in range(x.shape[1]):
        e = vexp(x[i, j] - m)
        out[i, j] = e
        t += e
    return t


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def softmax_rows(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = e / sum(e), e = exp(x - max x), along each row."""
    rows, n = x.shape
    maxima = _row_maxima(x)
    for i in range(rows):
        s = _store_exp(x, i, maxima[i], out)
        for j in range(n):
            out[i, j] = out[i, j] / s


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def log_softmax_rows(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = s - log(sum(exp(s))), s = x - max x, along each row."""
    rows, n = x.shape
    maxima = _row_maxima(x)
    for i in range(rows):
        m = maxima[i]
        lse = np.log(_sum_exp(x, i, m))
        for j in range(n):
            out[i, j] = (x[i, j] - m) - lse


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def log_softmax_grad_rows(y: Any, dy: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = dy - exp(y) sum(dy) along each row."""
    rows, n = y.shape
    for i in range(rows):
        s = y.dtype.type(0)
        for j in range(n):
            s += dy[i, j]
        for j in range(n):
            out[i, j] = dy[i, j] - vexp(y[i, j]) * s


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def softmax_grad_rows(y: Any, dy: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = y (dy - sum(dy y)) along each row."""
    rows, n = y.shape
    for i in range(rows):
        s = y.dtype.type(0)
        for j in range(n):
            s += dy[i, j] * y[i, j]
        for j in range(n):
            out[i, j] = (dy[i, j] - s) * y[i, j]


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, inline="always")
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


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def layer_norm_rows(x: Any, w: Any, b: Any, eps: float, out: Any) -> None:  # pragma: no cover - compiled
    """out = (x - mean) rstd w + b along each row."""
    rows, n = x.shape
    e = x.dtype.type(eps)
    for i in range(rows):
        mean, rstd = _row_stats(x, i, e)
        for j in range(n):
            out[i, j] = (x[i, j] - mean) * rstd * w[j] + b[j]


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, inline="always")
def _grad_stats(dy: Any, x: Any, w: Any, i: int, e: Any) -> tuple[Any, Any, Any, Any]:  # pragma: no cover
    """Row ``i``'s mean, rstd, mean(g) and rstd mean(g xhat), g = dy w, in one pass over the row. The
    sums are of d = x - x[i, 0] (the shifted-data variance: no cancellation while the row's values lie
    within a few deviations of its first one), so var = mean(d^2) - mean(d)^2 and sum(g (x - mean)) =
    sum(g d) - mean(d) sum(g) come from four sums the loop vectorises side by side."""
    n = x.shape[1]
    k = x[i, 0]
    zero = x.dtype.type(0)
    sd, sdd, sg, sgd = zero, zero, zero, zero
    for j in range(n):
        d = x[i, j] - k
        g = dy[i, j] * w[j]
        sd += d
        sdd += d * d
        sg += g
        sgd += g * d
    md = sd / n
    rstd = 1 / np.sqrt(max(sdd / n - md * md, zero) + e)  # rounding may take a constant row's below 0
    a = sg / n
    return k + md, rstd, a, rstd * rstd * (sgd / n - md * a)


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, inline="always")
def _dx_row(dy: Any, x: Any, w: Any, i: int, st: Any, dx: Any) -> None:  # pragma: no cover - compiled
    """dx[i] = (g - mean(g) - (x - mean) rstd mean(g xhat)) rstd, ``st[i]`` = _grad_stats' four values."""
    mean, rstd, a, b = st[i, 0], st[i, 1], st[i, 2], st[i, 3]
    for j in range(x.shape[1]):
        dx[i, j] = (dy[i, j] * w[j] - a - (x[i, j] - mean) * b) * rstd


_LN_BLOCK = 4  # rows whose dweight and dbias terms are added to the sums at once


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def layer_norm_grad_rows(
    dy: Any, x: Any, w: Any, eps: float, dx: Any, dw: Any, db: Any
) -> None:  # pragma: no cover - compiled
    """dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w; dw = sum(dy xhat), db = sum(dy) over
    the rows (written, not added to). Three passes, each a loop LLVM vectorises alone: every row's
    statistics (``_grad_stats``), dw and db with a block of 4 rows' terms a load and store of theirs,
    then dx. Row by row, with dw and db updated inside the row's loop, it ran 1.7x PyTorch's kernel on
    the main job's [1024, 64]; this way ~0.75x."""
    rows, n = x.shape
    e = x.dtype.type(eps)
    st = np.empty((rows, 4), x.dtype)  # every row's statistics, then the passes that read them
    for i in range(rows):
        st[i, 0], st[i, 1], st[i, 2], st[i, 3] = _grad_stats(dy, x, w, i, e)
    dw[:] = 0
    db[:] = 0
    full = rows - rows % _LN_BLOCK
    for i in range(0, full, _LN_BLOCK):
        m0, m1, m2, m3 = st[i, 0], st[i + 1, 0], st[i + 2, 0], st[i + 3, 0]
        r0, r1, r2, r3 = st[i, 1], st[i + 1, 1], st[i + 2, 1], st[i + 3, 1]
        for j in range(n):
            d0, d1, d2, d3 = dy[i, j], dy[i + 1, j], dy[i + 2, j], dy[i + 3, j]
            dw[j] += (
                d0 * (x[i, j] - m0) * r0
                + d1 * (x[i + 1, j] - m1) * r1
                + d2 * (x[i + 2, j] - m2) * r2
                + d3 * (x[i + 3, j] - m3) * r3
            )
            db[j] += d0 + d1 + d2 + d3
    for i in range(full, rows):
        for j in range(n):
            dw[j] += dy[i, j] * (x[i, j] - st[i, 0]) * st[i, 1]
            db[j] += dy[i, j]
    for i in range(rows):
        _dx_row(dy, x, w, i, st, dx)


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def cross_entropy_rows(x: Any, labels: Any, ignore: int, loss: Any) -> bool:  # pragma: no cover
    """loss = max x + log(sum(exp(x - max x))) - x[label] per row, 0 where label == ignore. False, at the
    first label neither ``ignore`` nor in -n..n-1 (the caller runs the numpy kernel, which raises numpy's
    IndexError for it)."""
    rows, n = x.shape
    maxima = _row_maxima(x)
    for i in range(rows):
        lab = labels[i]
        if lab == ignore:
            loss[i] = 0
            continue
        if lab < 0:
            lab += n  # numpy's take_along_axis counts a negative label from the end
        if not 0 <= lab < n:
            return False
        loss[i] = maxima[i] + np.log(_sum_exp(x, i, maxima[i])) - x[i, lab]
    return True


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def cross_entropy_grad_rows(
    x: Any, labels: Any, dy: Any, ignore: int, out: Any
) -> None:  # pragma: no cover - compiled
    """out = e dy / sum(e) - onehot(label) dy per row, e = exp(x - max x), dy taken as 0 where label ==
    ignore. A label outside 0..V-1 subtracts nothing."""
    rows, n = x.shape
    maxima = _row_maxima(x)
    for i in range(rows):
        lab = labels[i]
        d = x.dtype.type(0) if lab == ignore else dy[i]
        scale = d / _store_exp(x, i, maxima[i], out)
        for j in range(n):
            out[i, j] = out[i, j] * scale
        if 0 <= lab < n and lab != ignore:
            out[i, lab] = out[i, lab] - d


@njit(cache=True, error_model="numpy", nogil=True)
def add_rows_at(out: Any, ids: Any, start: int, values: Any) -> None:  # pragma: no cover - compiled
    """out[ids[r] - start] += values[r] for every row r whose id falls in out's rows (embedding_grad:
    each id's rows summed in row order, as the numpy kernel's stable sort and reduceat sum them)."""
    rows, n = values.shape
    size = out.shape[0]
    for r in range(rows):
        k = ids[r] - start
        if 0 <= k < size:
            for j in range(n):
                out[k, j] += values[r, j]


@njit(cache=True, error_model="numpy", nogil=True)
def take_rows(weight: Any, ids: Any, start: int, vocab: int, out: Any) -> int:  # pragma: no cover - compiled
    """out[r] = weight[ids[r] - start], or zeros where that falls outside weight's rows (embedding: the
    rows of this rank's vocabulary range; ids outside it look up zeros, as the numpy kernel's). One pass,
    where numpy made the range mask, its all(), then the take: 6.9 against 5.2 us for PyTorch. Returns
    the position of the first id outside the whole vocabulary ``[0, vocab)``, out unfinished, or -1: the
    check that took ids.min() and ids.max() before the loop (~6 us of the main job's 19-us lookup)."""
    size, n = weight.shape
    for r in range(ids.size):
        i = ids[r]
        if i < 0 or i >= vocab:
            return r
        k = i - start
        if 0 <= k < size:
            for j in range(n):
                out[r, j] = weight[k, j]
        else:
            for j in range(n):
                out[r, j] = 0
    return -1


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def sum_rows(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = the sum of x's rows (reduction.py's sum_to over leading axes: a bias gradient), four rows'
    sum added at a time: a row at a time, the load and store of ``out`` a row were half the loop (4.3
    against 2.1 us on [1024, 64] float32)."""
    rows, n = x.shape
    out[:] = 0
    full = rows - rows % 4
    for i in range(0, full, 4):
        for j in range(n):
            out[j] += (x[i, j] + x[i + 1, j]) + (x[i + 2, j] + x[i + 3, j])
    for i in range(full, rows):
        for j in range(n):
            out[j] += x[i, j]


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def sum_all(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = the sum of x, any shape, into a one-element out of any shape (reduction.py's sum of a whole
    array: the gradient norm's squares), in vector lanes: numpy's pairwise sum is not vectorised (3.0
    against 0.8 us on 64 x 256 float32). Flattened here, not by the caller: two reshapes in Python cost
    more than the sum of 64 values."""
    flat = x.reshape(x.size)
    s = x.dtype.type(0)
    for i in range(flat.size):
        s += flat[i]
    out.reshape(1)[0] = s


@njit(cache=True, error_model="numpy", nogil=True)
def sum_runs(flat: Any, bounds: Any, sums: Any) -> None:  # pragma: no cover - compiled
    """sums[g] = sum_all of flat[bounds[g]:bounds[g + 1]]: each run through sum_all's own compiled loop
    (called, not inlined, so its vector lanes add as they do alone; the same loop written here with
    runtime bounds summed in another order, 136 of 400 sizes differing)."""
    for g in range(bounds.size - 1):
        sum_all(flat[bounds[g] : bounds[g + 1]], sums[g : g + 1])


@njit(cache=True, error_model="numpy", nogil=True)
def add_in_order(sums: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out = ((sums[0] + sums[1]) + sums[2]) + ..., without fastmath: the order is the adds'."""
    total = sums[0]
    for g in range(1, sums.size):
        total = total + sums[g]
    out.reshape(1)[0] = total


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def max_rows(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[i] = max(x[i]), nan where the row has one (as numpy's max): ``vmax`` reduces in vector lanes
    but passes a nan over, so the same pass also sums the row, which a nan makes nan (as does inf - inf:
    such a row's nans are then counted one by one). A count of ``v != v`` in the pass kept LLVM from
    vectorising the pair: [1024, 256] float32 39 -> 17 us (torch's amax 20)."""
    rows, n = x.shape
    for i in range(rows):
        m = x[i, 0]
        s = x.dtype.type(0)
        for j in range(n):
            v = x[i, j]
            m = vmax(m, v)  # type: ignore[call-arg]
            s += v
        if s != s:
            for j in range(n):
                if x[i, j] != x[i, j]:
                    m = np.nan
                    break
        out[i] = m


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, inline="always")
def _chunk_row_max(cm: Any, i: int) -> Any:  # pragma: no cover - compiled
    """max(cm[i]), nan where the row has one (a nan, once taken, stays: nothing compares above it)."""
    m = cm[i, 0]
    for j in range(1, cm.shape[1]):
        v = cm[i, j]
        if v > m or v != v:
            m = v
    return m


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def vocab_terms_rows(
    x: Any, chunk_max: Any, offset: int, labels: Any, ignore: int, sum_exp: Any, target: Any
) -> None:  # pragma: no cover - compiled
    """vocab.py's vocab_terms per row i of x [rows, V] (this rank's classes, from class ``offset``):
    sum(exp(x[i] - max(chunk_max[i]))), and x[i, label - offset] where this rank holds the label (else 0,
    and 0 where the label is ``ignore``). One pass a row where numpy made five: [1024, 128] float32 in 2
    chunks, --clock cpu, load 6.4: 204 -> 81 us (torch's exp, sum and gather 91); the gradient 229 -> 81 (251)."""
    v = x.shape[1]
    for i in range(x.shape[0]):
        sum_exp[i] = _sum_exp(x, i, _chunk_row_max(chunk_max, i))
        local = labels[i] - offset
        hit = labels[i] != ignore and 0 <= local < v
        target[i] = x[i, local] if hit else x.dtype.type(0)


@njit(cache=True, error_model="numpy", fastmath=_FLAGS, nogil=True)
def vocab_terms_grad_rows(
    x: Any, chunk_max: Any, offset: int, labels: Any, ignore: int, dsum: Any, dtarget: Any, out: Any
) -> None:  # pragma: no cover - compiled
    """vocab.py's vocab_terms_grad per row: out[i] = exp(x[i] - max(chunk_max[i])) dsum[i], plus dtarget[i]
    at the label where this rank holds it (vocab_terms_rows' conditions)."""
    v = x.shape[1]
    for i in range(x.shape[0]):
        m, d = _chunk_row_max(chunk_max, i), dsum[i]
        for j in range(v):
            out[i, j] = vexp(x[i, j] - m) * d  # type: ignore[call-arg]
        local = labels[i] - offset
        if labels[i] != ignore and 0 <= local < v:
            out[i, local] += dtarget[i]


@njit(cache=True, error_model="numpy", nogil=True)
def concat_rows(srcs: Any, dst: Any) -> None:  # pragma: no cover - compiled
    """dst[i] = srcs[0][i], srcs[1][i], ... one after another (shape.py's concat along an inner axis, as
    rows ``[outer, inner]``: the q, k and v gradients of attention into one, 16 values a piece). One pass
    down dst, where numpy's concatenate copies each input through a strided loop of its own (51 against
    15 us on the main job's [4096, 3 x 16] float32). The tuple is indexed, not iterated: numba's loop over
    a tuple's items ran 3x slower."""
    rows = dst.shape[0]
    for i in range(rows):
        s = 0
        for q in range(len(srcs)):
            a = srcs[q]
            n = a.shape[1]
            for j in range(n):
                dst[i, s + j] = a[i, j]
            s += n


@njit(cache=True, error_model="numpy", nogil=True)
def vocab_loss_rows(
    labels: Any, chunk_max: Any, sum_exp: Any, target: Any, ignore: int, first: bool, loss: Any
) -> None:  # pragma: no cover - compiled
    """vocab.py's vocab_cross_entropy per row: max(chunk_max) + log(sum_exp) - target on the rank at class
    offset 0 (``first``), -target on the others, 0 where the label is ``ignore``; the row maximum is nan
    where a chunk's is, as numpy's max. Any shapes with one row a label (flattened here: reshapes in
    Python cost more than these rows)."""
    c = chunk_max.shape[-1]
    lab, cm, s, t, out = (
        labels.reshape(labels.size),
        chunk_max.reshape(-1, c),
        sum_exp.reshape(-1),
        target.reshape(-1),
        loss.reshape(-1),
    )
    for i in range(lab.size):
        if lab[i] == ignore:
            out[i] = 0
        elif first:
            m = cm[i, 0]
            for j in range(1, c):
                v = cm[i, j]
                if v > m or v != v:  # a nan, once taken, stays: nothing compares above it
                    m = v
            out[i] = m + np.log(s[i]) - t[i]
        else:
            out[i] = -t[i]


@njit(cache=True, error_model="numpy", nogil=True)
def vocab_loss_grad_rows(
    labels: Any, sum_exp: Any, dy: Any, ignore: int, dsum: Any, dtarget: Any
) -> None:  # pragma: no cover - compiled
    """vocab_cross_entropy_grad per row: dsum = dy / sum_exp, dtarget = -dy, both 0 where the label is
    ``ignore``; any shapes, one row a label."""
    lab, s, d = labels.reshape(labels.size), sum_exp.reshape(-1), dy.reshape(-1)
    ds, dt = dsum.reshape(-1), dtarget.reshape(-1)
    for i in range(lab.size):
        if lab[i] == ignore:
            ds[i] = 0
            dt[i] = 0
        else:
            ds[i] = d[i] / s[i]
            dt[i] = -d[i]
