"""Cases for sbpflow/ops/layers/conv.py.

The references loop over every output position and slice its window out of the padded input with
plain numpy (no strided views, no GEMM): the backward references add each position's contribution
back, one window at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case


def _out(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


@st.composite
def _conv(draw: st.DrawFn, backward: str = "") -> Example:
    groups = draw(st.sampled_from([1, 1, 2]))
    cg, og, n = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, 1)), draw(st.integers(0, 1)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    extent = [d * (k - 1) + 1 - 2 * p for k, d, p in zip(kernel, dilation, padding, strict=True)]
    hw = (draw(st.integers(max(1, extent[0]), 6)), draw(st.integers(max(1, extent[1]), 6)))
    attrs: dict[str, Any] = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    x = arrays((n, cg * groups, *hw), draw)
    w = arrays((og * groups, cg, *kernel), draw)
    oh, ow = (_out(hw[i], kernel[i], stride[i], padding[i], dilation[i]) for i in (0, 1))
    dy = arrays((n, og * groups, oh, ow), draw)
    if backward == "input":
        return Example((dy, w), {**attrs, "input_hw": hw})
    if backward == "weight":
        return Example((dy, x), {**attrs, "kernel_hw": kernel})
    return Example((x, w), attrs)


def _positions(x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any]) -> Any:
    """(output channel, i, j, the input channels and the window's slices in the padded input)."""
    (s0, s1), (p0, p1), (d0, d1), g = attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"]
    o, cg, kh, kw = w_shape
    oh = _out(x_shape[2], kh, s0, p0, d0)
    ow = _out(x_shape[3], kw, s1, p1, d1)
    for oc in range(o):
        grp = oc // (o // g)
        chans = slice(grp * cg, (grp + 1) * cg)
        for i in range(oh):
            for j in range(ow):
                rows = slice(i * s0, i * s0 + d0 * (kh - 1) + 1, d0)
                cols = slice(j * s1, j * s1 + d1 * (kw - 1) + 1, d1)
                yield oc, i, j, (slice(None), chans, rows, cols)


def _padded(x: np.ndarray, padding: tuple[int, int]) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))


def _conv_ref(x: np.ndarray, w: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    xp = _padded(x, attrs["padding"])
    out: dict[tuple[int, int, int], np.ndarray] = {}
    for oc, i, j, window in _positions(x.shape, w.shape, attrs):
        out[oc, i, j] = (xp[window] * w[oc]).sum(axis=(1, 2, 3))
    oh, ow = max(k[1] for k in out) + 1, max(k[2] for k in out) + 1
    y = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for (oc, i, j), v in out.items():
        y[:, oc, i, j] = v
    return [y]


def _conv_grad_input_ref(dy: np.ndarray, w: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    (h, wd), (p0, p1) = attrs["input_hw"], attrs["padding"]
    x_shape = (dy.shape[0], w.shape[1] * attrs["groups"], h, wd)
    dxp = np.zeros((x_shape[0], x_shape[1], h + 2 * p0, wd + 2 * p1))
    for oc, i, j, window in _positions(x_shape, w.shape, attrs):
        dxp[window] += dy[:, oc, i, j][:, None, None, None] * w[oc]
    return [dxp[:, :, p0 : p0 + h, p1 : p1 + wd]]


def _conv_grad_weight_ref(dy: np.ndarray, x: np.ndarray, **attrs: Any) -> list[np.ndarray]:
    kh, kw = attrs["kernel_hw"]
    w_shape = (dy.shape[1], x.shape[1] // attrs["groups"], kh, kw)
    xp = _padded(x, attrs["padding"])
    dw = np.zeros(w_shape)
    for oc, i, j, window in _positions(x.shape, w_shape, attrs):
        dw[oc] += np.einsum("n,nchw->chw", dy[:, oc, i, j], xp[window])
    return [dw]


case(OpCase("conv2d", _conv(), _conv_ref, differentiable=(0, 1)))
case(OpCase("conv2d_grad_input", _conv("input"), _conv_grad_input_ref, differentiable=()))
case(OpCase("conv2d_grad_weight", _conv("weight"), _conv_grad_weight_ref, differentiable=()))
