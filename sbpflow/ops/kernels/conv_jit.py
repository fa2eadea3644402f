"""im2row and its adjoint compiled with numba, and the convolutions built on them: conv.py's fast path
on numpy.

conv.py's numpy kernels lay the windows out taps-first (``cols [C*KH*KW, N*OH*OW]``), which numpy copies
one tap at a time, and contract them as ``weight @ cols``: OpenBLAS's sgemm runs that product, 16 rows
by 8,192 columns on a ResNet block, at half the speed of its transpose ``rows @ weight.T`` with the
positions as rows (216 against 472 us). These loops build that row layout, ``rows [N, OH, OW, KH, KW,
C]`` (one window a row, its channels innermost, as the weight reordered ``[KH, KW, C, O]`` reads it),
from the input made channels-last and padded once (``nhwc_padded``); each window's row of a kernel
row is then one contiguous run of ``KW * C`` values (``C`` with a dilation), which a flat loop copies
vectorised. ``add_rows_back`` is the adjoint, for the input gradient of a strided convolution. The
rows are built a block of samples at a time (``BLOCK_BYTES``) and consumed by the GEMM while in cache.
A 1x1 kernel without padding (ResNet's shortcuts) builds no rows: its window is one position of x, so
each convolution is one GEMM a sample on x as it lies, ``[C, OH*OW]`` (strided positions copied out
first), whose result is already channels first (conv2d 2.0 -> 0.75x PyTorch's on a stride-2 shortcut).
An image no larger than the kernel's window (``dense_taps``: ResNet's last stage, 2x2 under a 3x3
kernel with padding 1) builds no rows either: the convolution is one dense matrix [OH*OW*O, H*W*C]
(block (p, q) the tap by which output position p reads input q, zero where none), built from the weight
in its window-rows order by ``dense_weight``, so each op is one GEMM on channels-last samples, with
fewer multiplies than the rows (the padding's zeros are never multiplied) and no window copies; the
weight gradient is that GEMM's adjoint folded back onto the taps (``dense_fold``). --clock cpu, 1 thread,
load 2.7, [32, 128, 2, 2] by [128, 128, 3, 3]: conv2d 810 -> 330 us, grad_input 1020 -> 350, grad_weight
880 -> 400 (PyTorch 390-570, 380-620, 790-1040). It applies while the matrix is at most
DENSE_MAX_SHARE times the weight (a 4x4 image under 3x3: 16 x 16 blocks, too many multiplies).
Two paths take some convolutions before the rows, each reading x channels first as it lies:
``conv_taps`` (conv2d at stride 1 of 7 channels or fewer, 32 wide or more: a stem; its weight gradient
at any width) and
``conv_winograd`` (3x3 at stride 1 of 8 channels or more, 8 wide or more, the weight gradient too;
the input gradient at stride 1 through conv.py's flipped-weight conv2d).

They are the fast path only: conv.py's numpy kernels stay the reference and the path for cupy, for
grouped convolutions and for arrays these do not take (``rowwise.jit_loops``);
``tests/sbpflow/ops/kernels/test_conv_jit.py`` checks the convolutions they serve against them. Copies only, no
arithmetic but the adjoint's sums, which add a position's contributions in window order.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from numba import njit

from sbpflow.ops.kernels import conv_taps, conv_winograd
from sbpflow.ops.kernels.jit_streams import load, store

Pair = tuple[int, int]
# the window rows of this many bytes at a time (whole samples): they stay in L2 between im2row and the
# GEMM that reads them; all at once, a ResNet stem's 19 MB ran 1.5x slower
BLOCK_BYTES = 1 << 20
# the dense path's matrix at most this many times the weight's size (ResNet's 2x2 stage: 16/9)
DENSE_MAX_SHARE = 2


@njit(cache=True, error_model="numpy")
def nhwc_padded(x: Any, ph: int, pw: int, out: Any) -> None:  # pragma: no cover - compiled
    """out [N, H + 2 ph, W + 2 pw, C] = x [N, C, H, W] channels-last, zero in the padding. Flat indices
    and jit_streams' tags (no negative-index test an access, no overlap test a loop); with 8 channels or
    more a position's channels are written in a run, each read from its plane (as the window rows read
    them), with fewer a plane's row is read in a run. It was a loop per plane row into a row view:
    --clock cpu, 1 thread, load 3, alternated, old -> new: [32, 32, 8, 8] 60-78 -> 25-32 us, [32, 64, 4,
    4] 43-50 -> 15-16, [32, 16, 16, 16] 92-100 -> 47-48, [32, 3, 32, 32] 73-74 -> 43-44; bit for bit."""
    n_, c_, h_, w_ = x.shape
    hp, wp = out.shape[1], out.shape[2]
    src, dst = x.reshape(-1), out.reshape(-1)
    plane, line = h_ * w_, wp * c_
    for n in range(n_):
        base = n * hp * line
        for k in range(ph * line):
            store(dst, base + k, 0, 1)  # type: ignore[call-arg]
        for k in range((ph + h_) * line, hp * line):
            store(dst, base + k, 0, 1)  # type: ignore[call-arg]
        for h in range(h_):
            row, s0 = base + (h + ph) * line, n * c_ * plane + h * w_
            for k in range(pw * c_):
                store(dst, row + k, 0, 1)  # type: ignore[call-arg]
            for k in range((pw + w_) * c_, line):
                store(dst, row + k, 0, 1)  # type: ignore[call-arg]
            if c_ >= 8:
                for w in range(w_):
                    at = row + (w + pw) * c_
                    for c in range(c_):
                        store(dst, at + c, load(src, s0 + c * plane + w, 0), 1)  # type: ignore[call-arg]
            else:
                for c in range(c_):
                    for w in range(w_):
                        store(dst, row + (w + pw) * c_ + c, load(src, s0 + c * plane + w, 0), 1)  # type: ignore[call-arg]


@njit(cache=True, error_model="numpy", inline="always")
def _walk(
    rows: Any,
    padded: Any,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    back: bool,
) -> None:  # pragma: no cover - compiled
    """Every window's runs, in row-major order of the rows [N, OH, OW, KH, KW, C]: copied from padded
    [N, HP, WP, C] into rows, or (``back``) added from rows into padded."""
    n_, oh_, ow_ = rows.shape[0], rows.shape[1], rows.shape[2]
    c_ = padded.shape[3]
    run = kernel[1] * c_ if dilation[1] == 1 else c_  # contiguous values a copy
    parts = 1 if dilation[1] == 1 else kernel[1]
    row_flat, pad_flat = rows.reshape(-1), padded.reshape(-1)
    line = padded.shape[2] * c_
    at = 0
    for n in range(n_):
        for oh in range(oh_):
            for ow in range(ow_):
                for i in range(kernel[0]):
                    base = (n * padded.shape[1] + oh * stride[0] + i * dilation[0]) * line + ow * stride[
                        1
                    ] * c_
                    for part in range(parts):
                        start = base + part * dilation[1] * c_
                        window, row = pad_flat[start : start + run], row_flat[at : at + run]
                        if back:
                            for k in range(run):  # over 1-d views: LLVM vectorises this, not flat[at + k]
                                window[k] += row[k]
                        else:
                            for k in range(run):
                                row[k] = window[k]
                        at += run


@njit(cache=True, error_model="numpy")
def im2row(
    padded: Any, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int], rows: Any
) -> None:  # pragma: no cover - compiled
    """rows [N, OH, OW, KH, KW, C] = the padded channels-last input's window at every output position."""
    _walk(rows, padded, kernel, stride, dilation, False)


@njit(cache=True, error_model="numpy")
def add_rows_back(
    rows: Any, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int], padded: Any
) -> None:  # pragma: no cover - compiled
    """The adjoint of :func:`im2row`: padded [N, HP, WP, C] = zeros plus every window row added back
    where it was read, positions in row-major order."""
    flat = padded.reshape(-1)
    for k in range(flat.size):
        flat[k] = 0
    _walk(rows, padded, kernel, stride, dilation, True)


@njit(cache=True, nogil=True, error_model="numpy")
def dense_weight(wr: Any, taps: Any, dense: Any) -> None:  # pragma: no cover - compiled
    """dense [OH*OW*O, H*W*C]: block (p, q) is wr[:, taps[p, q]] [O, C] transposed to rows of C, the tap
    of output position p that reads input position q, or zero where none does (``taps[p, q] < 0``)."""
    p_, q_ = taps.shape
    o_, c_ = wr.shape[0], wr.shape[2]
    for p in range(p_):
        for o in range(o_):
            row = dense[p * o_ + o]
            for q in range(q_):
                t, seg = taps[p, q], row[q * c_ : (q + 1) * c_]
                if t < 0:
                    for c in range(c_):
                        seg[c] = 0
                else:
                    src = wr[o, t]
                    for c in range(c_):
                        seg[c] = src[c]


@njit(cache=True, nogil=True, error_model="numpy")
def dense_fold(dense: Any, taps: Any, wr: Any) -> None:  # pragma: no cover - compiled
    """The adjoint of :func:`dense_weight`: wr [O, KH*KW, C] = zeros plus each block (p, q) of dense
    added to its tap, blocks in row-major order of (p, o, q)."""
    p_, q_ = taps.shape
    o_, c_ = wr.shape[0], wr.shape[2]
    flat = wr.reshape(-1)
    for k in range(flat.size):
        flat[k] = 0
    for p in range(p_):
        for o in range(o_):
            row = dense[p * o_ + o]
            for q in range(q_):
                t = taps[p, q]
                if t >= 0:
                    seg, dst = row[q * c_ : (q + 1) * c_], wr[o, t]
                    for c in range(c_):
                        dst[c] += seg[c]


def _padded(x: Any, padding: Pair) -> Any:
    n, c, h, w = x.shape
    out = np.empty((n, h + 2 * padding[0], w + 2 * padding[1], c), dtype=x.dtype)
    nhwc_padded(x, padding[0], padding[1], out)
    return out


def _out_hw(hw: Pair, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair) -> Pair:
    oh, ow = ((hw[a] + 2 * padding[a] - dilation[a] * (kernel[a] - 1) - 1) // stride[a] + 1 for a in (0, 1))
    return oh, ow


def _blocks(n: int, sample_bytes: int) -> tuple[int, list[tuple[int, int]]]:
    """Whole samples of about BLOCK_BYTES of window rows: the block size, and each block's [n0, n1)."""
    b = max(1, min(n, BLOCK_BYTES // max(1, sample_bytes)))
    return b, [(n0, min(n, n0 + b)) for n0 in range(0, n, b)]


def _weight_rows(w: Any) -> Any:
    """w [O, C, KH, KW] as [O, KH*KW*C], the window rows' order: a copy, channels moved last within each
    filter (2.4x sooner than the full transpose to [KH*KW*C, O]: 36 against 86 us for a 128-channel
    3x3; the GEMMs take its transpose as a flag)."""
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1)).reshape(w.shape[0], -1)


@lru_cache(maxsize=128)
def dense_taps(hw: Pair, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair) -> Any | None:
    """taps [OH*OW, H*W]: the tap ``i KW + j`` by which output position p reads input position q, -1
    where none does; None where the dense path does not apply: an image larger than the kernel's window
    (more multiplies than the window rows) or a dense matrix over DENSE_MAX_SHARE times the weight."""
    oh, ow = _out_hw(hw, kernel, stride, padding, dilation)
    area, taps_n = hw[0] * hw[1], kernel[0] * kernel[1]
    if area > taps_n or area * oh * ow > DENSE_MAX_SHARE * taps_n:
        return None
    taps = np.full((oh * ow, area), -1, np.int64)
    for a, b, i, j in np.ndindex(oh, ow, *kernel):
        h, w = a * stride[0] - padding[0] + i * dilation[0], b * stride[1] - padding[1] + j * dilation[1]
        if 0 <= h < hw[0] and 0 <= w < hw[1]:
            taps[a * ow + b, h * hw[1] + w] = i * kernel[1] + j
    taps.flags.writeable = False
    return taps


def _dense(w: Any, taps: Any) -> Any:
    """The convolution by w [O, C, KH, KW] as one matrix [OH*OW*O, H*W*C] on channels-last samples."""
    o, c = w.shape[:2]
    dense = np.empty((taps.shape[0] * o, taps.shape[1] * c), w.dtype)
    dense_weight(_weight_rows(w).reshape(o, -1, c), taps, dense)
    return dense


def _last(a: Any) -> Any:
    """a [N, C, H, W] channels-last, flat a sample: [N, H*W*C]."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).reshape(a.shape[0], -1)


def _first(a: Any, shape: tuple[int, int, int, int], out: Any = None) -> Any:
    """The inverse of :func:`_last`: a [N, H*W*C] as [N, C, H, W] = ``shape``, into ``out`` if given."""
    n, c, h, w = shape
    return into(out, a.reshape(n, h, w, c).transpose(0, 3, 1, 2))


def into(out: Any, a: Any) -> Any:
    """``a`` as a C-contiguous array: copied into ``out`` (a lent buffer of its shape and dtype, or None:
    a new array). The same values either way: a copy does no arithmetic."""
    if out is None:
        return np.ascontiguousarray(a)
    np.copyto(out, a)
    return out


def _pointwise(kernel: Pair, padding: Pair) -> bool:
    """A 1x1 kernel without padding: each window is one position of x, read in place (no window rows)."""
    return kernel == (1, 1) and padding == (0, 0)


def _positions(x: Any, stride: Pair) -> Any:
    """x [N, C, H, W] at a 1x1 kernel's positions, as [N, C, OH*OW] (a copy only when strided)."""
    taken = x[:, :, :: stride[0], :: stride[1]] if stride != (1, 1) else x
    return np.ascontiguousarray(taken).reshape(x.shape[0], x.shape[1], -1)


def conv(x: Any, w: Any, stride: Pair, padding: Pair, dilation: Pair, out: Any = None) -> Any:
    """conv2d of x [N, C, H, W] by w [O, C, KH, KW]: a block of samples' window rows at a time by the
    GEMM rows @ w' [KH*KW*C, O] (OpenBLAS's fast order for few output channels and many positions),
    each block's result [positions, O] written channels first. A 1x1 kernel without padding: one GEMM
    w [O, C] @ x [C, OH*OW] a sample, straight into the output's layout. Every path writes y into
    ``out`` where given (a lent C-contiguous buffer of y's shape and dtype): the same GEMMs, so the
    same bits."""
    n, c = x.shape[:2]
    o, kernel = w.shape[0], (w.shape[2], w.shape[3])
    oh, ow = _out_hw(x.shape[2:], kernel, stride, padding, dilation)
    if _pointwise(kernel, padding):
        y = np.empty((n, o, oh, ow), x.dtype) if out is None else out
        np.matmul(w.reshape(o, -1), _positions(x, stride), out=y.reshape(n, o, oh * ow))
        return y
    if (taps := dense_taps(x.shape[2:], kernel, stride, padding, dilation)) is not None:
        yt = _dense(w, taps) @ _last(x).T  # [OH*OW*O, N]: the dense matrix as the GEMM's left side
        return into(out, yt.reshape(oh, ow, o, n).transpose(3, 2, 0, 1))
    if conv_taps.applies(c, stride, ow):
        return conv_taps.conv(x, w, padding, dilation, out)
    if conv_winograd.applies(c, kernel, stride, dilation, ow):
        return conv_winograd.conv(x, w, padding, out)
    padded, wk, k = _padded(x, padding), _weight_rows(w).T, kernel[0] * kernel[1] * c
    b, blocks = _blocks(n, oh * ow * k * x.itemsize)
    rows, part = np.empty((b, oh, ow, *kernel, c), x.dtype), np.empty((b * oh * ow, o), x.dtype)
    y = np.empty((n, o, oh * ow), x.dtype) if out is None else out.reshape(n, o, oh * ow)
    for n0, n1 in blocks:
        m = (n1 - n0) * oh * ow
        im2row(padded[n0:n1], kernel, stride, dilation, rows[: n1 - n0])
        np.matmul(rows[: n1 - n0].reshape(m, k), wk, out=part[:m])
        y[n0:n1] = part[:m].reshape(n1 - n0, oh * ow, o).transpose(0, 2, 1)
    return y.reshape(n, o, oh, ow) if out is None else out


def conv_grad_weight(
    dy: Any, x: Any, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair, out: Any = None
) -> Any:
    """dw [O, C, KH, KW] = sum over blocks of samples of dy' [O, positions] @ their window rows; with a
    1x1 kernel without padding, sum over samples of dy [O, OH*OW] @ x [C, OH*OW]' (no window rows).
    Into ``out`` where given, as :func:`conv`."""
    n, c = x.shape[:2]
    o = dy.shape[1]
    if _pointwise(kernel, padding):
        per_sample = np.matmul(dy.reshape(n, o, -1), _positions(x, stride).transpose(0, 2, 1))
        dw = np.empty((o, c, 1, 1), dy.dtype) if out is None else out
        np.sum(per_sample, axis=0, out=dw.reshape(o, c))
        return dw
    oh, ow = _out_hw(x.shape[2:], kernel, stride, padding, dilation)
    if (taps := dense_taps(x.shape[2:], kernel, stride, padding, dilation)) is not None:
        wr = np.empty((o, kernel[0] * kernel[1], c), x.dtype)
        dense_fold(_last(dy).T @ _last(x), taps, wr)
        return into(out, wr.reshape(o, *kernel, c).transpose(0, 3, 1, 2))
    if conv_taps.applies_grad_weight(c, stride):
        if (dw := conv_taps.grad_weight(dy, x, kernel, padding, dilation, out)) is not None:
            return dw  # None: x holds an inf or a nan, which the grid's zero columns would meet
    if conv_winograd.applies(c, kernel, stride, dilation, ow):
        return conv_winograd.grad_weight(dy, x, padding, out)
    padded, k = _padded(x, padding), kernel[0] * kernel[1] * c
    b, blocks = _blocks(n, oh * ow * k * x.itemsize)
    rows = np.empty((b, oh, ow, *kernel, c), x.dtype)
    dw = np.zeros((o, k), dy.dtype)
    for n0, n1 in blocks:
        im2row(padded[n0:n1], kernel, stride, dilation, rows[: n1 - n0])
        dw += dy[n0:n1].transpose(1, 0, 2, 3).reshape(o, -1) @ rows[: n1 - n0].reshape(-1, k)
    return into(out, dw.reshape(o, *kernel, c).transpose(0, 3, 1, 2))


def conv_grad_input(
    dy: Any, w: Any, hw: Pair, stride: Pair, padding: Pair, dilation: Pair, out: Any = None
) -> Any:
    """dx [N, C, *hw] for any stride: a block's window rows' gradient dy' @ w' [O, KH*KW*C], each row
    added back where its window read (add_rows_back), then channels first. A 1x1 kernel without
    padding: w' [C, O] @ dy [O, OH*OW] a sample, placed at every stride-th position of a zero dx.
    Into ``out`` where given, as :func:`conv`."""
    n, o, oh, ow = dy.shape
    c, kernel = w.shape[1], (w.shape[2], w.shape[3])
    if _pointwise(kernel, padding):
        dense = stride == (1, 1) and (oh, ow) == tuple(hw)
        dx = np.empty((n, c, *hw), dy.dtype) if out is None else out
        wt, d3 = w.reshape(o, c).T, dy.reshape(n, o, oh * ow)
        if dense:
            np.matmul(wt, d3, out=dx.reshape(n, c, oh * ow))
            return dx
        dx.fill(0)
        dx[:, :, : oh * stride[0] : stride[0], : ow * stride[1] : stride[1]] = np.matmul(wt, d3).reshape(
            n, c, oh, ow
        )
        return dx
    if (taps := dense_taps(tuple(hw), kernel, stride, padding, dilation)) is not None:
        return _first(_last(dy) @ _dense(w, taps), (n, c, *hw), out)
    wk_t, k = _weight_rows(w), kernel[0] * kernel[1] * c
    padded = np.empty((n, hw[0] + 2 * padding[0], hw[1] + 2 * padding[1], c), dy.dtype)
    _, blocks = _blocks(n, oh * ow * k * dy.itemsize)
    for n0, n1 in blocks:
        rows = dy[n0:n1].transpose(0, 2, 3, 1).reshape(-1, o) @ wk_t
        add_rows_back(rows.reshape(n1 - n0, oh, ow, *kernel, c), kernel, stride, dilation, padded[n0:n1])
    inner = padded[:, padding[0] : padding[0] + hw[0], padding[1] : padding[1] + hw[1]]
    return into(out, inner.transpose(0, 3, 1, 2))
