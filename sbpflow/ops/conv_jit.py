"""im2row and its adjoint compiled with numba: the window copies of conv.py's convolution kernels, for
numpy.

conv.py's numpy kernels lay the windows out taps-first (``cols [C*KH*KW, N*OH*OW]``), which numpy copies
one tap at a time, and contract them as ``weight @ cols``: OpenBLAS's sgemm runs that product, 16 rows
by 8,192 columns on a ResNet block, at half the speed of its transpose ``rows @ weight.T`` with the
positions as rows (216 against 472 us). These loops build that row layout, ``rows [N, OH, OW, KH, KW,
C]`` (one window a row, its channels innermost, as the weight reordered ``[KH, KW, C, O]`` reads it),
from the input made channels-last and padded once (``nhwc_padded``); each window's row of a kernel
row is then one contiguous run of ``KW * C`` values (``C`` with a dilation), which a flat loop copies
vectorised. ``add_rows_back`` is the adjoint, for the input gradient of a strided convolution.

They are the fast path only: conv.py's numpy kernels stay the reference and the path for cupy, for
grouped convolutions and for arrays these do not take (``conv.jit_loops``);
``tests/sbpflow/ops/test_conv_jit.py`` checks the convolutions they serve against them. Copies only, no
arithmetic but the adjoint's sums, which add a position's contributions in window order.
"""

from __future__ import annotations

from typing import Any

from numba import njit


@njit(cache=True, error_model="numpy")
def nhwc_padded(x: Any, ph: int, pw: int, out: Any) -> None:  # pragma: no cover - compiled
    """out [N, H + 2 ph, W + 2 pw, C] = x [N, C, H, W] channels-last, zero in the padding."""
    n_, c_, h_, w_ = x.shape
    hp = out.shape[1]
    for n in range(n_):
        for h in range(hp):
            line = out[n, h].reshape(-1)
            src = h - ph
            if src < 0 or src >= h_:
                for k in range(line.size):
                    line[k] = 0
                continue
            for k in range(pw * c_):
                line[k] = 0
            for k in range((pw + w_) * c_, line.size):
                line[k] = 0
            for c in range(c_):
                plane_row = x[n, c, src]
                for w in range(w_):
                    line[(w + pw) * c_ + c] = plane_row[w]


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
