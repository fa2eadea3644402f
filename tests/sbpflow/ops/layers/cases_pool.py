"""Cases for sbpflow/ops/layers/pool.py.

References loop over output positions with plain slices of the padded input (-inf padding for the
max, zeros counted in the mean), and over torch's adaptive bins written out as index arithmetic.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case


def _geometry(attrs: dict[str, Any]) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    k, s, p = attrs["kernel_size"], attrs["stride"], attrs["padding"]
    return k, (k if s == (0, 0) else s), p


def _windows(shape: tuple[int, ...], attrs: dict[str, Any]) -> Any:
    """(i, j, the window's slices in the padded input) for every output position."""
    (kh, kw), (s0, s1), (p0, p1) = _geometry(attrs)
    oh = (shape[2] + 2 * p0 - kh) // s0 + 1
    ow = (shape[3] + 2 * p1 - kw) // s1 + 1
    for i in range(oh):
        for j in range(ow):
            yield i, j, (slice(None), slice(None), slice(i * s0, i * s0 + kh), slice(j * s1, j * s1 + kw))


def _pad(x: np.ndarray, attrs: dict[str, Any], fill: float) -> np.ndarray:
    p0, p1 = attrs["padding"]
    return np.pad(x, ((0, 0), (0, 0), (p0, p0), (p1, p1)), constant_values=fill)


def _pooled_shape(shape: tuple[int, ...], attrs: dict[str, Any]) -> tuple[int, ...]:
    positions = list(_windows(shape, attrs))
    return (*shape[:2], positions[-1][0] + 1, positions[-1][1] + 1)


@st.composite
def _pool(draw: st.DrawFn, backward: str = "") -> Example:
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = draw(st.sampled_from([(0, 0), (1, 1), (1, 2), (2, 1)]))
    padding = (draw(st.integers(0, kernel[0] // 2)), draw(st.integers(0, kernel[1] // 2)))
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(kernel[0], 6)))
    shape += (draw(st.integers(kernel[1], 6)),)
    attrs: dict[str, Any] = {"kernel_size": kernel, "stride": stride, "padding": padding}
    x = arrays(shape, draw)
    dy = arrays(_pooled_shape(shape, attrs), draw)
    if backward == "max":
        return Example((x, dy), attrs)
    if backward == "avg":
        return Example((dy,), {**attrs, "input_hw": shape[2:]})
    return Example((x,), attrs)


def _max_pool_ref(x: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    xp = _pad(x, attrs, -np.inf)
    y = np.zeros(_pooled_shape(x.shape, attrs))
    for i, j, win in _windows(x.shape, attrs):
        y[:, :, i, j] = xp[win].max(axis=(2, 3))
    return [y]


def _max_pool_grad_ref(x: np.ndarray, dy: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    xp = _pad(x, attrs, -np.inf)
    dxp = np.zeros_like(xp)
    for i, j, (_, _, rows, cols) in _windows(x.shape, attrs):
        for n, c in np.ndindex(*x.shape[:2]):
            patch = xp[n, c, rows, cols]
            r, q = np.unravel_index(np.argmax(patch), patch.shape)  # the first maximum, row-major
            dxp[n, c, rows.start + r, cols.start + q] += dy[n, c, i, j]
    p0, p1 = attrs["padding"]
    return [dxp[:, :, p0 : p0 + x.shape[2], p1 : p1 + x.shape[3]]]


def _avg_pool_ref(x: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    xp = _pad(x, attrs, 0.0)
    (kh, kw), _, _ = _geometry(attrs)
    y = np.zeros(_pooled_shape(x.shape, attrs))
    for i, j, win in _windows(x.shape, attrs):
        y[:, :, i, j] = xp[win].sum(axis=(2, 3)) / (kh * kw)
    return [y]


def _avg_pool_grad_ref(dy: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    shape = (*dy.shape[:2], *attrs["input_hw"])
    dxp = _pad(np.zeros(shape), attrs, 0.0)
    (kh, kw), _, (p0, p1) = _geometry(attrs)
    for i, j, win in _windows(shape, attrs):
        dxp[win] += dy[:, :, i, j][:, :, None, None] / (kh * kw)
    return [dxp[:, :, p0 : p0 + shape[2], p1 : p1 + shape[3]]]


case(OpCase("max_pool2d", _pool(), _max_pool_ref, grad_rtol=1e-4))
case(OpCase("max_pool2d_grad", _pool("max"), _max_pool_grad_ref, differentiable=()))
case(OpCase("avg_pool2d", _pool(), _avg_pool_ref))
case(OpCase("avg_pool2d_grad", _pool("avg"), _avg_pool_grad_ref, differentiable=()))


# ---- adaptive_avg_pool2d -------------------------------------------------------------------------


@st.composite
def _adaptive(draw: st.DrawFn, backward: bool = False) -> Example:
    shape = tuple(draw(st.integers(1, 4)) for _ in range(2)) + (
        draw(st.integers(1, 7)),
        draw(st.integers(1, 7)),
    )
    out = (draw(st.integers(1, shape[2])), draw(st.integers(1, shape[3])))
    if backward:
        return Example((arrays((*shape[:2], *out), draw),), {"output_size": out, "input_hw": shape[2:]})
    return Example((arrays(shape, draw),), {"output_size": out})


def _bin(i: int, size: int, out: int) -> slice:
    return slice(int(np.floor(i * size / out)), int(np.ceil((i + 1) * size / out)))


def _adaptive_ref(x: np.ndarray, output_size: tuple[int, int]) -> list[np.ndarray]:
    y = np.zeros((*x.shape[:2], *output_size))
    for i, j in np.ndindex(*output_size):
        y[:, :, i, j] = x[
            :, :, _bin(i, x.shape[2], output_size[0]), _bin(j, x.shape[3], output_size[1])
        ].mean(axis=(2, 3))
    return [y]


def _adaptive_grad_ref(dy: np.ndarray, output_size: tuple[int, int], input_hw: tuple[int, int]) -> list:
    dx = np.zeros((*dy.shape[:2], *input_hw))
    for i, j in np.ndindex(*output_size):
        rows, cols = _bin(i, input_hw[0], output_size[0]), _bin(j, input_hw[1], output_size[1])
        area = (rows.stop - rows.start) * (cols.stop - cols.start)
        dx[:, :, rows, cols] += dy[:, :, i, j][:, :, None, None] / area
    return [dx]


case(OpCase("adaptive_avg_pool2d", _adaptive(), _adaptive_ref))
case(OpCase("adaptive_avg_pool2d_grad", _adaptive(True), _adaptive_grad_ref, differentiable=()))
