"""Shifted taps: conv_jit's path for stride-1 convolutions of few input channels (a network's stem).

With 3 channels, a window row of conv_jit's im2row is 3x3 runs of 3 values, which copy slowly, and its
GEMM's result [positions, O] still needs a transpose to channels first. Here a sample is padded as it
lies, channels first, ``[C, HP + 1, WP]``, and the output is computed on the padded grid ``[OH, WP]``
(the columns past OW are dropped): tap (c, i, j) of every output position then reads one contiguous
run of the padded sample, ``OH * WP`` values from ``(i DH) WP + j DW``, so ``cols [C*KH*KW, OH*WP]`` is
C*KH*KW long copies, and ``w [O, C*KH*KW] @ cols`` is already ``[O, positions]`` (the weight as it lies).
ResNet-18's stem [32, 3, 32, 32] -> 16 (--clock cpu, 1 thread): 1.47 -> 0.91 ms (PyTorch 0.67). Its
weight gradient keeps the window rows: ``dy' @ cols'`` on the grid, a sample or a block of samples at a
time, was no sooner (1.24-1.38 against 1.27 ms).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from sbpflow.ops.kernels.jit_streams import load, store

Pair = tuple[int, int]
# 8 channels and more: conv_winograd or the window rows are sooner; so are outputs under 32 wide (a
# [32, 4, 16, 16] -> 8 took 1.3x the window rows' time)
MAX_CHANNELS, MIN_WIDTH = 7, 32


def applies(c: int, stride: Pair, out_w: int) -> bool:
    """Whether conv2d of c input channels takes the shifted taps (see the module's docstring)."""
    return stride == (1, 1) and c <= MAX_CHANNELS and out_w >= MIN_WIDTH


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
