"""Convolution: conv2d (NCHW; stride, padding, dilation, groups) and its two backward ops.

Kernels: im2col by kernel taps. The padded input, channels first ``[C, N, H, W]``, is copied once per
tap (i, j) into ``cols [C, KH, KW, N, OH, OW]`` (each a strided 4-d slice: 2-3x sooner than copying a
6-d window view), so that one GEMM per group contracts the weight ``[O, C*KH*KW]`` (its own layout, no
transpose) with ``cols [C*KH*KW, N*OH*OW]``. The weight gradient is one GEMM of dy ``[O, N*OH*OW]``
with the same cols. The input gradient, with stride 1, is the convolution of dy by the flipped weight;
strided, one GEMM to the taps' gradients, added back one slice per tap.

Rows: the spatial axes are never split (a window straddles shards: that needs halos, i.e. communication,
which kernels do not do). The batch splits freely. With ``groups == 1`` the channel axes split too: the
weight's output channels (its ``S(0)``) give the output's channels ``S(1)``, and the input channels
(``S(1)`` of both x and the weight) are a contracted axis, so each rank holds a partial sum ``P``.
With groups, a channel split would have to fall on group boundaries, which an uneven split need not.
"""

from __future__ import annotations

from math import prod
from types import ModuleType
from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops.base import Attrs, AttrValue, KernelContext, Metas, NoGrad, Signature, defop, sig
from sbpflow.ops.kernels.rowwise import jit_loops
from sbpflow.ops.rows import all_broadcast
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta

_CONV_ATTRS: dict[str, AttrValue] = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1}


def check_float(op: str, **tensors: TensorMeta) -> None:
    """Every tensor floating, and of one dtype."""
    for name, m in tensors.items():
        if not m.dtype.is_floating:
            raise ShapeError(f"op {op!r} needs a float {name}, got {m}; cast {name} to a float dtype first")
    if len({m.dtype for m in tensors.values()}) > 1:
        listed = ", ".join(f"{n} {m}" for n, m in tensors.items())
        raise ShapeError(f"op {op!r} needs one dtype for {listed}; cast them to one dtype")


def pair(op: str, attrs: Attrs, key: str, low: int) -> tuple[int, int]:
    v = attrs[key]
    v = (v, v) if isinstance(v, int) else tuple(v)
    if len(v) != 2 or any(int(a) < low for a in v):
        raise ShapeError(f"op {op!r}: {key}={attrs[key]!r} must be an int or a pair of ints >= {low}")
    return int(v[0]), int(v[1])


def out_size(size: int, k: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


def _geometry(op: str, attrs: Attrs) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], int]:
    groups = int(attrs["groups"])
    if groups < 1:
        raise ShapeError(f"op {op!r}: groups={groups} must be positive")
    return pair(op, attrs, "stride", 1), pair(op, attrs, "padding", 0), pair(op, attrs, "dilation", 1), groups


def _conv_out(op: str, x: TensorMeta, w: TensorMeta, attrs: Attrs) -> tuple[int, ...]:
    """The output shape of a conv of x [N, C, H, W] by w [O, C/groups, KH, KW], or a ShapeError."""
    if x.ndim != 4 or w.ndim != 4:
        raise ShapeError(f"op {op!r}: x {x} must be [N, C, H, W] and weight {w} [O, C/groups, KH, KW]")
    stride, padding, dilation, groups = _geometry(op, attrs)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    if c % groups or o % groups or cg * groups != c:
        raise ShapeError(
            f"op {op!r}: x {x} has {c} channels and weight {w} takes {cg} per group with groups={groups}; "
            f"both channel counts must divide by groups and weight.shape[1] * groups must equal {c}"
        )
    oh = out_size(h, kh, stride[0], padding[0], dilation[0])
    ow = out_size(wd, kw, stride[1], padding[1], dilation[1])
    if oh < 1 or ow < 1:
        raise ShapeError(f"op {op!r}: the kernel {[kh, kw]} (dilated) is larger than the padded input {x}")
    return (n, o, oh, ow)


def windows(xp: Any, x: Any, kernel: tuple[int, int], attrs: Attrs, fill: float = 0.0) -> Any:
    """The padded ``x`` [N, C, H, W] as a strided view of its windows [N, C, OH, OW, KH, KW]."""
    stride, padding, dilation = (pair("conv", attrs, k, 0) for k in ("stride", "padding", "dilation"))
    pads = ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2)
    xp_ = xp.ascontiguousarray(xp.pad(x, pads, constant_values=fill) if any(padding) else x)
    n, c, h, w = xp_.shape
    oh = (h - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    s = xp_.strides
    return xp.lib.stride_tricks.as_strided(
        xp_,
        (n, c, oh, ow, *kernel),
        (s[0], s[1], s[2] * stride[0], s[3] * stride[1], s[2] * dilation[0], s[3] * dilation[1]),
    )


def scatter_windows(xp: Any, cols: Any, in_shape: tuple[int, ...], attrs: Attrs) -> Any:
    """The adjoint of :func:`windows`: add each window's values [N, C, OH, OW, KH, KW] back into x."""
    stride, padding, dilation = (pair("conv", attrs, k, 0) for k in ("stride", "padding", "dilation"))
    n, c, h, w = in_shape
    _, _, oh, ow, kh, kw = cols.shape
    dx = xp.zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), dtype=cols.dtype)
    for i in range(kh):
        for j in range(kw):
            r, q = i * dilation[0], j * dilation[1]
            dx[
                :,
                :,
                r : r + stride[0] * (oh - 1) + 1 : stride[0],
                q : q + stride[1] * (ow - 1) + 1 : stride[1],
            ] += cols[:, :, :, :, i, j]
    return dx[:, :, padding[0] : padding[0] + h, padding[1] : padding[1] + w]


def tap_slices(
    kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int], out_hw: tuple[int, int]
) -> list[tuple[int, int, slice, slice]]:
    """For each kernel tap (i, j), row-major, the (rows, columns) of the padded input it reads in every
    window, as slices giving [OH, OW]."""
    (oh, ow), taps = out_hw, []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            r, q = i * dilation[0], j * dilation[1]
            taps.append(
                (
                    i,
                    j,
                    slice(r, r + stride[0] * (oh - 1) + 1, stride[0]),
                    slice(q, q + stride[1] * (ow - 1) + 1, stride[1]),
                )
            )
    return taps


def _im2col_geometry(attrs: Attrs, kernel: tuple[int, int], hw: tuple[int, int]) -> tuple[Any, ...]:
    stride, padding, dilation = (pair("conv", attrs, k, 0) for k in ("stride", "padding", "dilation"))
    oh, ow = (out_size(hw[a], kernel[a], stride[a], padding[a], dilation[a]) for a in (0, 1))
    return padding, tap_slices(kernel, stride, dilation, (oh, ow)), (oh, ow)


def im2col(xp: Any, x: Any, kernel: tuple[int, int], attrs: Attrs) -> Any:
    """x [N, C, H, W] as cols [C, KH, KW, N, OH, OW]: what each kernel tap reads in every window."""
    n, c, h, w = x.shape
    (ph, pw), taps, (oh, ow) = _im2col_geometry(attrs, kernel, (h, w))
    xt = xp.zeros((c, n, h + 2 * ph, w + 2 * pw), dtype=x.dtype)
    xt[:, :, ph : ph + h, pw : pw + w] = x.transpose(1, 0, 2, 3)
    cols = xp.empty((c, *kernel, n, oh, ow), dtype=x.dtype)
    for i, j, rows, columns in taps:
        cols[:, i, j] = xt[:, :, rows, columns]
    return cols


def col2im(xp: Any, cols: Any, in_shape: tuple[int, ...], attrs: Attrs) -> Any:
    """The adjoint of :func:`im2col`: each tap's values [C, N, OH, OW] added back; dx [N, C, H, W]."""
    n, c, h, w = in_shape
    (ph, pw), taps, _ = _im2col_geometry(attrs, cols.shape[1:3], (h, w))
    dxt = xp.zeros((c, n, h + 2 * ph, w + 2 * pw), dtype=cols.dtype)
    for i, j, rows, columns in taps:
        dxt[:, :, rows, columns] += cols[:, i, j]
    return xp.ascontiguousarray(dxt[:, :, ph : ph + h, pw : pw + w].transpose(1, 0, 2, 3))


def _grouped(xp: Any, g: int, parts: list[Any], axis: int) -> Any:
    return parts[0] if g == 1 else xp.concatenate(parts, axis=axis)


# ---- conv2d --------------------------------------------------------------------------------------


def _conv_infer(metas: Metas, attrs: Attrs) -> Metas:
    x, w = metas
    check_float("conv2d", x=x, weight=w)
    return (TensorMeta(_conv_out("conv2d", x, w, attrs), x.dtype),)


def _channel_rows(attrs: Attrs, rows: list[Signature]) -> list[Signature]:
    return rows if int(attrs["groups"]) == 1 else []


def _conv_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    return [
        sig([Split(0), B], [Split(0)]),
        *_channel_rows(
            attrs,
            [
                sig([B, Split(0)], [Split(1)]),  # each rank computes the output channels of its filters
                sig([Split(1), Split(1)], [P]),  # input channels are contracted: partial sums
            ],
        ),
        sig([P, B], [P]),  # linear in x
        sig([B, P], [P]),  # linear in the weight
        all_broadcast(2, 1),
    ]


def _fast(xp: Any, a: Any, attrs: Attrs) -> ModuleType | None:
    """conv_jit, where its window rows may run a convolution kernel reading ``a``: groups 1 (a group's
    channels would not be one run of a row) and an array jit_loops takes."""
    return jit_loops("conv_jit", xp, a) if int(attrs["groups"]) == 1 else None


def _geometry3(attrs: Attrs) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    return (
        pair("conv", attrs, "stride", 1),
        pair("conv", attrs, "padding", 0),
        pair("conv", attrs, "dilation", 1),
    )


def _conv(xp: Any, x: Any, w: Any, attrs: Attrs, out: Any = None) -> Any:
    """conv2d of x [N, C, H, W] by w [O, C/groups, KH, KW]: im2col, then one GEMM per group. conv_jit's
    paths write y into ``out``, a lent buffer (``KernelContext.out_contiguous``), where given."""
    if (jit := _fast(xp, x, attrs)) is not None:
        return jit.conv(x, w, *_geometry3(attrs), out=out)
    g = int(attrs["groups"])
    cols = im2col(xp, x, w.shape[2:], attrs)  # [C, KH, KW, N, OH, OW]
    c, kh, kw, n, oh, ow = cols.shape
    og, k = w.shape[0] // g, c // g * kh * kw
    flat, wf = cols.reshape(c * kh * kw, n * oh * ow), w.reshape(w.shape[0], k)
    parts = [wf[q * og : (q + 1) * og] @ flat[q * k : (q + 1) * k] for q in range(g)]  # [O/g, N*OH*OW]
    y = _grouped(xp, g, parts, 0).reshape(w.shape[0], n, oh, ow)
    return xp.ascontiguousarray(y.transpose(1, 0, 2, 3))


def _conv_kernel(ctx: KernelContext, x: Any, w: Any) -> Any:
    return _conv(ctx.xp, x, w, ctx.attrs, ctx.out_contiguous(0))


def _conv_flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    # w [C_out, C_in/groups, kh, kw]: one multiply-add per tap of every output
    return 2 * outs[0].numel * prod(ins[1].shape[1:])


defop(
    "conv2d",
    inputs=("x", "weight"),
    infer=_conv_infer,
    rows=_conv_rows,
    kernel=_conv_kernel,
    grad=lambda g: [
        g.call("conv2d_grad_input", g.dy, g.inputs[1], input_hw=g.in_metas[0].shape[2:], **g.attrs),
        g.call("conv2d_grad_weight", g.dy, g.inputs[0], kernel_hw=g.in_metas[1].shape[2:], **g.attrs),
    ],
    attrs=_CONV_ATTRS,
    doc="2-d cross-correlation of x [N, C, H, W] with weight [O, C/groups, KH, KW] (no bias), as torch",
    flops=_conv_flops,
)


# ---- conv2d_grad_input ---------------------------------------------------------------------------


def _grad_input_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, w = metas
    check_float("conv2d_grad_input", dy=dy, weight=w)
    h, wd = pair("conv2d_grad_input", attrs, "input_hw", 1)
    x = TensorMeta((dy.shape[0], w.shape[1] * int(attrs["groups"]), h, wd), dy.dtype)
    if dy.ndim != 4 or _conv_out("conv2d_grad_input", x, w, attrs) != dy.shape:
        raise ShapeError(f"op 'conv2d_grad_input': dy {dy} is not the output of conv2d of {x} by weight {w}")
    return (x,)


def _grad_input_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    return [
        sig([Split(0), B], [Split(0)]),
        *_channel_rows(
            attrs,
            [
                sig([Split(1), Split(0)], [P]),  # output channels are contracted: partial sums
                sig([B, Split(1)], [Split(1)]),  # each rank's filters' input channels
            ],
        ),
        sig([P, B], [P]),
        sig([B, P], [P]),
        all_broadcast(2, 1),
    ]


def _transposed_conv(xp: Any, dy: Any, w: Any, attrs: Attrs, out: Any = None) -> Any | None:
    """With stride 1, the input gradient is itself a convolution: of dy, padded by d(k-1) - p, with the
    weight's taps flipped and its channel axes swapped per group. None where that padding is negative."""
    stride, padding, dilation = (pair("conv", attrs, k, 0) for k in ("stride", "padding", "dilation"))
    kernel, g = w.shape[2:], int(attrs["groups"])
    pad = tuple(dilation[a] * (kernel[a] - 1) - padding[a] for a in (0, 1))
    if stride != (1, 1) or min(pad) < 0:
        return None
    og = w.shape[0] // g
    flipped = [w[q * og : (q + 1) * og, :, ::-1, ::-1].transpose(1, 0, 2, 3) for q in range(g)]
    return _conv(xp, dy, _grouped(xp, g, flipped, 0), {**attrs, "padding": pad}, out)  # [N, C, H, W]


def _grad_input_kernel(ctx: KernelContext, dy: Any, w: Any) -> Any:
    xp, g = ctx.xp, int(ctx.attrs["groups"])
    stride, padding, dilation = _geometry3(ctx.attrs)
    hw = pair("conv2d_grad_input", ctx.attrs, "input_hw", 1)
    outs = tuple(out_size(hw[a], w.shape[2 + a], stride[a], padding[a], dilation[a]) for a in (0, 1))
    # add_rows_back does not bounds-check; numpy raises on a shard of another shape
    jit = _fast(xp, dy, ctx.attrs) if outs == dy.shape[2:] else None
    lent = ctx.out_contiguous(0)  # the fast paths write dx into the runtime's dead buffer
    if jit is not None and jit.dense_taps(hw, tuple(w.shape[2:]), stride, padding, dilation) is not None:
        return jit.conv_grad_input(dy, w, hw, stride, padding, dilation, lent)  # a small image: one GEMM
    direct = _transposed_conv(xp, dy, w, ctx.attrs, lent)
    if direct is not None:
        return direct
    if jit is not None:
        return jit.conv_grad_input(dy, w, hw, stride, padding, dilation, lent)
    n, o, oh, ow = dy.shape  # strided: the taps' gradients by one GEMM, added back one tap at a time
    og = o // g
    _, cg, kh, kw = w.shape
    d2 = dy.transpose(1, 0, 2, 3).reshape(o, n * oh * ow)  # [O, N*OH*OW] (a copy)
    wf = w.reshape(o, cg * kh * kw)
    parts = [wf[q * og : (q + 1) * og].T @ d2[q * og : (q + 1) * og] for q in range(g)]  # [C/g*KH*KW, P]
    cols = _grouped(xp, g, parts, 0).reshape(cg * g, kh, kw, n, oh, ow)
    h, wd = pair("conv2d_grad_input", ctx.attrs, "input_hw", 1)
    return col2im(xp, cols, (n, cg * g, h, wd), ctx.attrs)


def _grad_input_flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    # dx = conv_transpose(dy, w): every tap of every dy element again
    return 2 * ins[0].numel * prod(ins[1].shape[1:])


defop(
    "conv2d_grad_input",
    inputs=("dy", "weight"),
    outputs=("dx",),
    infer=_grad_input_infer,
    rows=_grad_input_rows,
    kernel=_grad_input_kernel,
    grad=NoGrad("backward op of conv2d"),
    attrs={**_CONV_ATTRS, "input_hw": (1, 1)},
    doc="gradient of conv2d w.r.t. its input x [N, C, *input_hw] (a transposed convolution of dy)",
    flops=_grad_input_flops,
)


# ---- conv2d_grad_weight --------------------------------------------------------------------------


def _grad_weight_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, x = metas
    check_float("conv2d_grad_weight", dy=dy, x=x)
    kh, kw = pair("conv2d_grad_weight", attrs, "kernel_hw", 1)
    groups = int(attrs["groups"])
    if dy.ndim != 4 or x.ndim != 4 or x.shape[1] % max(groups, 1):
        raise ShapeError(
            f"op 'conv2d_grad_weight': dy {dy} and x {x} must be [N, C, H, W], C divisible by groups"
        )
    w = TensorMeta((dy.shape[1], x.shape[1] // groups, kh, kw), dy.dtype)
    if _conv_out("conv2d_grad_weight", x, w, attrs) != dy.shape:
        raise ShapeError(f"op 'conv2d_grad_weight': dy {dy} is not the output of conv2d of x {x} by {w}")
    return (w,)


def _grad_weight_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    return [
        sig([Split(0), Split(0)], [P]),  # the batch is contracted: each rank's samples give a partial sum
        *_channel_rows(
            attrs,
            [
                sig([Split(1), B], [Split(0)]),  # the gradient of each rank's filters
                sig([B, Split(1)], [Split(1)]),  # ... of each rank's input channels
            ],
        ),
        sig([P, B], [P]),
        sig([B, P], [P]),
        all_broadcast(2, 1),
    ]


def _grad_weight_kernel(ctx: KernelContext, dy: Any, x: Any) -> Any:
    xp, g = ctx.xp, int(ctx.attrs["groups"])
    kernel = pair("conv2d_grad_weight", ctx.attrs, "kernel_hw", 1)
    if (jit := _fast(xp, x, ctx.attrs)) is not None:
        return jit.conv_grad_weight(dy, x, kernel, *_geometry3(ctx.attrs), out=ctx.out_contiguous(0))
    cols = im2col(xp, x, kernel, ctx.attrs)  # [C, KH, KW, N, OH, OW]
    c, kh, kw, n, oh, ow = cols.shape
    o = dy.shape[1]
    og, k = o // g, c // g * kh * kw
    d2 = dy.transpose(1, 0, 2, 3).reshape(o, n * oh * ow)
    flat = cols.reshape(c * kh * kw, n * oh * ow)
    parts = [d2[q * og : (q + 1) * og] @ flat[q * k : (q + 1) * k].T for q in range(g)]  # [O/g, C/g*KH*KW]
    return _grouped(xp, g, parts, 0).reshape(o, c // g, kh, kw)


def _grad_weight_flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    # dw = correlate(x, dy): one multiply-add per (dy element, tap of dw's input channels)
    return 2 * ins[0].numel * prod(outs[0].shape[1:])


defop(
    "conv2d_grad_weight",
    inputs=("dy", "x"),
    outputs=("dweight",),
    infer=_grad_weight_infer,
    rows=_grad_weight_rows,
    kernel=_grad_weight_kernel,
    grad=NoGrad("backward op of conv2d"),
    attrs={**_CONV_ATTRS, "kernel_hw": (1, 1)},
    doc="gradient of conv2d w.r.t. its weight [O, C/groups, *kernel_hw]: dy contracted with x's windows",
    flops=_grad_weight_flops,
)
