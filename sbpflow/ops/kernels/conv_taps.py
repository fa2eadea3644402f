"""Shifted taps: conv_jit's path for stride-1 convolutions of few input channels (a network's stem).

With 3 channels, a window row of conv_jit's im2row is 3x3 runs of 3 values, which copy slowly, and its
GEMM's result [positions, O] still needs a transpose to channels first. Here a sample is padded as it
lies, channels first, ``[C, HP + 1, WP]``, and the output is computed on the padded grid ``[OH, WP]``
(the columns past OW are dropped): tap (c, i, j) of every output position then reads one contiguous
run of the padded sample, ``OH * WP`` values from ``(i DH) WP + j DW``, so ``cols [C*KH*KW, OH*WP]`` is
C*KH*KW long copies, and ``w [O, C*KH*KW] @ cols`` is already ``[O, positions]`` (the weight as it lies).
ResNet-18's stem [32, 3, 32, 32] -> 16 (--clock cpu, 1 thread): 1.47 -> 0.91 ms (PyTorch 0.67).

The weight gradient (``grad_weight``, any width) uses the same grid: dw[o, c, i, j] is one dot product of
dy's sample, laid on the grid ``[O, OH, WP]`` with zeros in the columns past OW, with the run tap (c, i, j)
reads, ``OH * WP`` values long, four output channels a pass over the run (one load of x for four
products). Those are reduction loops, compiled with jit_math's FLAGS so that LLVM sums in vector lanes:
as a GEMM, ``dy' @ cols'`` on the grid or the window rows', OpenBLAS ran 16 rows by 27 columns at a
fifth of its speed. The stem's [32, 3, 32, 32] -> 16, float32, --clock cpu: 1.09-1.51 -> 0.48-0.56 ms
(PyTorch 0.45); with one channel, 28 wide, 5x5 to 32: 1.49 -> 0.77. A zero column of dy would turn an
infinite x it meets into nan (0 * inf), in a tap whose true sum does not read it: where x is not all
finite (one pass, ``finite``) conv_jit keeps the window rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from sbpflow.ops.kernels.jit_math import FLAGS
from sbpflow.ops.kernels.jit_streams import load, store

Pair = tuple[int, int]
# 8 channels and more: conv_winograd or the window rows are sooner; so are outputs under 32 wide (a
# [32, 4, 16, 16] -> 8 took 1.3x the window rows' time)
MAX_CHANNELS, MIN_WIDTH = 7, 32


def applies(c: int, stride: Pair, out_w: int) -> bool:
    """Whether conv2d of c input channels takes the shifted taps (see the module's docstring)."""
    return stride == (1, 1) and c <= MAX_CHANNELS and out_w >= MIN_WIDTH


def applies_grad_weight(c: int, stride: Pair) -> bool:
    """Whether conv2d_grad_weight of c input channels takes the grid's dot products: at any width (a
    [32, 3, 16, 16] -> 16 took 0.65x the window rows' time; at 8 channels they are level)."""
    return stride == (1, 1) and c <= MAX_CHANNELS


@njit(cache=True, error_model="numpy")
def shifted(grid: Any, kernel: Pair, dilation: Pair, cols: Any) -> None:  # pragma: no cover - compiled
    """cols [C, KH, KW, L] = grid [C, HG, WG] flat from (i DH) WG + j DW on, L values a tap."""
    c_, hg, wg = grid.shape
    l_ = cols.shape[3]
    src, dst = grid.reshape(-1), cols.reshape(-1)
    at = 0
    for c in range(c_):
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                start = c * hg * wg + i * dilation[0] * wg + j * dilation[1]
                for q in range(l_):
                    store(dst, at + q, load(src, start + q, 0), 1)  # type: ignore[call-arg]
                at += l_


def _geometry(x: Any, kernel: Pair, padding: Pair, dilation: Pair) -> tuple[int, int, Any, Any]:
    """The output [OH, OW], a zero padded sample [C, HP + 1, WP] (the extra row: the last taps' reads
    past OW) and cols [C, KH, KW, OH * WP]."""
    c, h, w = x.shape[1:]
    hp, wp = h + 2 * padding[0], w + 2 * padding[1]
    oh, ow = hp - dilation[0] * (kernel[0] - 1), wp - dilation[1] * (kernel[1] - 1)
    grid = np.zeros((c, hp + 1, wp), x.dtype)
    return oh, ow, grid, np.empty((c, *kernel, oh * wp), x.dtype)


def _fill(x: Any, s: int, padding: Pair, grid: Any) -> Any:
    grid[:, padding[0] : padding[0] + x.shape[2], padding[1] : padding[1] + x.shape[3]] = x[s]
    return grid


def conv(x: Any, w: Any, padding: Pair, dilation: Pair, out: Any = None) -> Any:
    """conv2d of x [N, C, H, W] by w [O, C, KH, KW] at stride 1: a GEMM a sample on the padded grid,
    into ``out`` where given (a lent buffer of y's shape and dtype)."""
    n, o, kernel = x.shape[0], w.shape[0], (w.shape[2], w.shape[3])
    oh, ow, grid, cols = _geometry(x, kernel, padding, dilation)
    flat, wf = cols.reshape(-1, cols.shape[3]), w.reshape(o, -1)
    part = np.empty((o, cols.shape[3]), x.dtype)
    y = np.empty((n, o, oh, ow), x.dtype) if out is None else out
    for s in range(n):
        shifted(_fill(x, s, padding, grid), kernel, dilation, cols)
        np.matmul(wf, flat, out=part)
        y[s] = part.reshape(o, oh, -1)[:, :, :ow]
    return y


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS, inline="always")
def _dots4(d: Any, at: int, size: int, g: Any, start: int) -> Any:  # pragma: no cover - compiled
    """The dot products of g's run of ``size`` values from ``start`` with d's four runs from ``at``,
    ``size`` apart: the run loaded once for four output channels."""
    s0 = s1 = s2 = s3 = d.dtype.type(0)
    for q in range(size):
        v = load(g, start + q, 0)  # type: ignore[call-arg,var-annotated]
        s0 += load(d, at + q, 0) * v  # type: ignore[call-arg]
        s1 += load(d, at + size + q, 0) * v  # type: ignore[call-arg]
        s2 += load(d, at + 2 * size + q, 0) * v  # type: ignore[call-arg]
        s3 += load(d, at + 3 * size + q, 0) * v  # type: ignore[call-arg]
    return s0, s1, s2, s3


@njit(cache=True, nogil=True, error_model="numpy")
def finite(a: Any) -> bool:  # pragma: no cover - compiled
    """Whether every value of the 1-d a is finite: ``v - v`` is nan for an inf or a nan. Called on its
    own, without fastmath: called from grid_grad_weight, under its flags, the check was folded away."""
    bad = 0  # counted as an integer, which vectorises without reassociating float sums
    for k in range(a.size):
        v = load(a, k, 0)  # type: ignore[call-arg,var-annotated]
        bad += (v - v) != 0
    return bad == 0


@njit(cache=True, nogil=True, error_model="numpy", fastmath=FLAGS)
def grid_grad_weight(
    dy: Any, x: Any, padding: Pair, dilation: Pair, dw: Any
) -> None:  # pragma: no cover - compiled
    """dw [O, C, KH, KW] = the sum over samples of each tap's dot product on the grid (see the module's
    docstring), for an x whose values are all finite."""
    n_, o_, oh, ow = dy.shape
    c_, h_, w_ = x.shape[1], x.shape[2], x.shape[3]
    kh, kw = dw.shape[2], dw.shape[3]
    hp, wp = h_ + 2 * padding[0], w_ + 2 * padding[1]
    size, chan = oh * wp, (hp + 1) * wp  # a run; a channel of the grid (the extra row: the last taps' reads)
    grid, dyg = np.zeros(c_ * chan, x.dtype), np.zeros(o_ * size, x.dtype)
    src, dsrc, out = x.reshape(-1), dy.reshape(-1), dw.reshape(-1)
    taps = c_ * kh * kw
    for k in range(out.size):
        out[k] = 0
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                to, at = c * chan + (padding[0] + h) * wp + padding[1], ((n * c_ + c) * h_ + h) * w_
                for w in range(w_):
                    store(grid, to + w, load(src, at + w, 0), 1)  # type: ignore[call-arg]
        for o in range(o_):
            for h in range(oh):
                to, at = o * size + h * wp, ((n * o_ + o) * oh + h) * ow
                for w in range(ow):
                    store(dyg, to + w, load(dsrc, at + w, 0), 1)  # type: ignore[call-arg]
        four = o_ - o_ % 4
        for o in range(o_):  # four output channels a pass from each multiple of 4 below ``four``
            if o < four and o % 4:
                continue
            t = 0
            for c in range(c_):
                for i in range(kh):
                    for j in range(kw):
                        start = c * chan + i * dilation[0] * wp + j * dilation[1]
                        if o < four:
                            r = _dots4(dyg, o * size, size, grid, start)
                            for k in range(4):
                                out[(o + k) * taps + t] += r[k]
                        else:
                            s = x.dtype.type(0)
                            for q in range(size):
                                s += load(dyg, o * size + q, 0) * load(grid, start + q, 0)  # type: ignore[call-arg]
                            out[o * taps + t] += s
                        t += 1


def grad_weight(dy: Any, x: Any, kernel: Pair, padding: Pair, dilation: Pair, out: Any = None) -> Any | None:
    """dw [O, C, KH, KW] of a stride-1 convolution of x [N, C, H, W] giving dy [N, O, OH, OW], into ``out``
    where given (a lent C-contiguous buffer of dw's shape and dtype); None where x is not all finite
    (``out`` untouched)."""
    x = np.ascontiguousarray(x)
    if not finite(x.reshape(-1)):
        return None
    dw = np.empty((dy.shape[1], x.shape[1], *kernel), x.dtype) if out is None else out
    grid_grad_weight(np.ascontiguousarray(dy), x, padding, dilation, dw)
    return dw
