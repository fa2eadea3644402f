"""Batch norm's per-channel passes compiled with numba: norm_stats.py's fast path on numpy.

A channel's values are the planes ``x[n, c]`` of every sample: the loops take x as ``[N, C, S]`` (S the
flattened spatial axes, a view of a C-contiguous x) and make one vectorised pass down each plane,
centred on the channel's mean where the formula is. Sums accumulate in float64 for any input dtype, so
that a float32 channel of a million values keeps its statistics to float32's rounding; they
reassociate (``FLAGS``), so that they vectorise: their last bits may differ from numpy's.

reduction.py's mean over every axis but the channels (``F.batch_norm``'s) and its gradient take
``channel_sums`` and ``fill_planes``: in ResNet-18's trace (32x32, width 16, batch 32; load ~3.9, one run
each) mean 2.0 -> 1.2 and mean_grad 1.5 -> 0.8 ms of CPU a step.

numpy makes a pass per step of a formula (the composite batch norm these replace made ~6 forward and
~12 backward passes, each a temporary); these make 3 and about 5. ``tests/sbpflow/ops/kernels/test_norm_jit.py``
checks each against norm_stats.py's numpy kernels, which stay the reference and the path for cupy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from sbpflow.ops.kernels.jit_math import FLAGS


@njit(cache=True, error_model="numpy", fastmath=FLAGS, nogil=True)
def centred_squares(x: Any, mean: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[c] = sum of (x[:, c] - mean[c])^2 (float64), x [N, C, S]."""
    n_, c_, _ = x.shape
    for c in range(c_):
        m, q = np.float64(mean[c]), 0.0
        for n in range(n_):
            plane = x[n, c]
            for k in range(plane.size):
                d = np.float64(plane[k]) - m
                q += d * d
        out[c] = q


@njit(cache=True, error_model="numpy", fastmath=FLAGS, nogil=True)
def centred_affine(x: Any, mean: Any, scale: Any, shift: Any, y: Any) -> None:  # pragma: no cover
    """y[n, c] = (x[n, c] - mean[c]) * scale[c] + shift[c], x and y [N, C, S]."""
    n_, c_, _ = x.shape
    for n in range(n_):
        for c in range(c_):
            m, a, b = mean[c], scale[c], shift[c]
            src, dst = x[n, c], y[n, c]
            for k in range(src.size):
                dst[k] = (src[k] - m) * a + b


@njit(cache=True, error_model="numpy", fastmath=FLAGS, nogil=True)
def centred_affine_sum(x: Any, mean: Any, scale: Any, y: Any, total: Any) -> None:  # pragma: no cover
    """y[n, c] = (x[n, c] - mean[c]) * scale[c], and total[c] = sum of x[:, c] - mean[c] (float64)."""
    n_, c_, _ = x.shape
    for c in range(c_):
        m, a, s = mean[c], scale[c], 0.0
        for n in range(n_):
            src, dst = x[n, c], y[n, c]
            for k in range(src.size):
                d = src[k] - m
                dst[k] = d * a
                s += np.float64(src[k]) - np.float64(m)
        total[c] = s


@njit(cache=True, error_model="numpy", fastmath=FLAGS, nogil=True)
def centred_dot_sum(dy: Any, x: Any, mean: Any, dot: Any, total: Any) -> None:  # pragma: no cover
    """dot[c] = sum of dy[:, c] (x[:, c] - mean[c]), total[c] = sum of dy[:, c] (float64): one pass."""
    n_, c_, _ = x.shape
    for c in range(c_):
        m, s, d = np.float64(mean[c]), 0.0, 0.0
        for n in range(n_):
            g, v = dy[n, c], x[n, c]
            for k in range(v.size):
                gk = np.float64(g[k])
                s += gk
                d += gk * (np.float64(v[k]) - m)
        dot[c], total[c] = d, s


@njit(cache=True, error_model="numpy", fastmath=FLAGS, nogil=True)
def channel_sums(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[c] = sum of x[:, c] (float64), x [N, C, S]: batch norm's mean over every axis but the
    channels, one vectorised pass down each plane (numpy's sum over axes (0, 2, 3) took ~1 ns a value,
    a strided reduction it does not vectorise)."""
    n_, c_, _ = x.shape
    for c in range(c_):
        s = 0.0
        for n in range(n_):
            plane = x[n, c]
            for k in range(plane.size):
                s += np.float64(plane[k])
        out[c] = s


@njit(cache=True, error_model="numpy", nogil=True)
def fill_planes(v: Any, y: Any) -> None:  # pragma: no cover - compiled
    """y[n, c, :] = v[c], y [N, C, S]: a per-channel value broadcast over the batch and the positions
    (mean_grad's), each plane one vectorised fill (numpy's copy from a stride-0 view ran a value at a
    time). A copy: the same bits."""
    n_, c_, _ = y.shape
    for n in range(n_):
        for c in range(c_):
            plane, a = y[n, c], v[c]
            for k in range(plane.size):
                plane[k] = a


@njit(cache=True, error_model="numpy", fastmath=FLAGS, nogil=True)
def centred_sums(x: Any, mean: Any, out: Any) -> None:  # pragma: no cover - compiled
    """out[c] = sum of x[:, c] - mean[c] (float64), x [N, C, S]: channel_var_grad's dmean sum, no dx."""
    n_, c_, _ = x.shape
    for c in range(c_):
        m, s = np.float64(mean[c]), 0.0
        for n in range(n_):
            plane = x[n, c]
            for k in range(plane.size):
                s += np.float64(plane[k]) - m
        out[c] = s


@njit(cache=True, error_model="numpy", fastmath=FLAGS, nogil=True)
def input_grad(dy: Any, x: Any, mean: Any, scale: Any, k: Any, d: Any, dx: Any) -> None:  # pragma: no cover
    """dx[n, c] = dy[n, c] scale[c] + (x[n, c] - mean[c]) k[c] + d[c], all [N, C, S] or [C]: batch norm's
    input gradient in one pass (channel_input_grad)."""
    n_, c_, _ = x.shape
    for n in range(n_):
        for c in range(c_):
            m, a, b, e = mean[c], scale[c], k[c], d[c]
            g, v, out = dy[n, c], x[n, c], dx[n, c]
            for i in range(v.size):
                out[i] = g[i] * a + (v[i] - m) * b + e
