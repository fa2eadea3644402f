"""Pooling over NCHW images: max_pool2d, avg_pool2d, adaptive_avg_pool2d, and their backward ops.

Rows: each output element reads one window of one (sample, channel) plane, so the batch and channel
axes split freely and the spatial axes stay whole (a window straddling shards would need halos). The
average pools are linear, so they also take ``P`` to ``P``; max pooling is not (max(a) + max(b) is not
max(a + b)), but its backward op is linear in dy.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops.base import (
    Attrs,
    AttrValue,
    GradContext,
    KernelContext,
    Metas,
    NoGrad,
    Signature,
    defop,
    sig,
)
from sbpflow.ops.kernels.rowwise import jit_loops
from sbpflow.ops.layers.conv import check_float, out_size, pair, scatter_windows, tap_slices, windows
from sbpflow.ops.rows import all_broadcast
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta

# stride (0, 0): the kernel size, as torch's stride=None
_POOL_ATTRS: dict[str, AttrValue] = {"kernel_size": (2, 2), "stride": (0, 0), "padding": (0, 0)}


def _geometry(op: str, attrs: Attrs) -> dict[str, tuple[int, int]]:
    """kernel, stride (defaulting to the kernel) and padding, plus dilation 1 for conv's window helpers:
    checked once for each op and attributes (5 us of every call of a ~35 us kernel), a new dict a call."""
    try:
        return dict(_checked_geometry(op, *(attrs[k] for k in _POOL_ATTRS)))
    except TypeError:  # unhashable attributes (lists): checked every call
        return dict(_checked_geometry.__wrapped__(op, *(attrs[k] for k in _POOL_ATTRS)))


@lru_cache(maxsize=256)
def _checked_geometry(op: str, kernel_size: Any, stride: Any, padding: Any) -> dict[str, tuple[int, int]]:
    attrs = {"kernel_size": kernel_size, "stride": stride, "padding": padding}
    kernel = pair(op, attrs, "kernel_size", 1)
    strides = pair(op, attrs, "stride", 0)
    strides = kernel if strides == (0, 0) else pair(op, attrs, "stride", 1)
    pads = pair(op, attrs, "padding", 0)
    if pads[0] * 2 > kernel[0] or pads[1] * 2 > kernel[1]:
        raise ShapeError(f"op {op!r}: padding {list(pads)} must be at most half the kernel {list(kernel)}")
    return {"kernel": kernel, "stride": strides, "padding": pads, "dilation": (1, 1)}


def _pool_shape(op: str, x: TensorMeta, attrs: Attrs) -> tuple[int, ...]:
    if x.ndim != 4:
        raise ShapeError(f"op {op!r}: x {x} must be [N, C, H, W]")
    g = _geometry(op, attrs)
    oh, ow = (out_size(x.shape[2 + i], g["kernel"][i], g["stride"][i], g["padding"][i], 1) for i in (0, 1))
    if oh < 1 or ow < 1:
        raise ShapeError(f"op {op!r}: the kernel {list(g['kernel'])} is larger than the padded input {x}")
    return (*x.shape[:2], oh, ow)


def _window_flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    # a window's taps per element of the larger side (the windowed input, or a backward op's dx)
    kernel = attrs.get("kernel_size", (1, 1))
    taps = prod(kernel) if isinstance(kernel, tuple) else 1
    return max(outs[0].numel, ins[0].numel) * max(int(taps), 1)


def _planes_rows(n_in: int, linear: tuple[Signature, ...] = ()) -> list[Signature]:
    return [
        *(sig([Split(a)] * n_in, [Split(a)]) for a in (0, 1)),  # whole planes on each rank
        *linear,
        all_broadcast(n_in, 1),
    ]


def _infer(op: str, backward: bool = False) -> Any:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        check_float(op, **{f"in{i}": m for i, m in enumerate(metas)})
        if not backward:
            return (TensorMeta(_pool_shape(op, metas[0], attrs), metas[0].dtype),)
        x, dy = (metas[0], metas[-1]) if len(metas) == 2 else (_grad_x(op, metas[0], attrs), metas[0])
        if _pool_shape(op, x, attrs) != dy.shape:
            raise ShapeError(f"op {op!r}: dy {dy} is not the pooled shape of x {x}")
        return (x,)

    return infer


def _grad_x(op: str, dy: TensorMeta, attrs: Attrs) -> TensorMeta:
    return TensorMeta((*dy.shape[:2], *pair(op, attrs, "input_hw", 1)), dy.dtype)


# ---- max_pool2d ----------------------------------------------------------------------------------


def _taps(g: dict[str, tuple[int, int]], out_hw: tuple[int, int]) -> list[tuple[slice, ...]]:
    """For each kernel tap, row-major, the index into the padded input of what it reads in every window."""
    taps = tap_slices(g["kernel"], g["stride"], g["dilation"], out_hw)
    return [(slice(None), slice(None), rows, columns) for _, _, rows, columns in taps]


def _padded(xp: Any, x: Any, g: dict[str, tuple[int, int]]) -> Any:
    ph, pw = g["padding"]
    return xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-xp.inf) if ph or pw else x


def _out_hw(x: Any, g: dict[str, tuple[int, int]]) -> tuple[int, int]:
    k, s, p = g["kernel"], g["stride"], g["padding"]
    return out_size(x.shape[2], k[0], s[0], p[0], 1), out_size(x.shape[3], k[1], s[1], p[1], 1)


def _max_pool_kernel(ctx: KernelContext, x: Any) -> Any:
    # the running maximum over the taps: KH*KW elementwise maxima, no window copy; -inf padding never wins
    xp, g = ctx.xp, _geometry("max_pool2d", ctx.attrs)
    # the loops where there is padding, which numpy copies first (--clock cpu, load ~5: [32, 16, 32, 32]
    # 3x3 stride 2 padding 1 1.6 -> 1.1 ms); without, numpy's passes were as soon (2x2 stride 2: 140 us
    # against the loops' 155)
    if g["padding"] != (0, 0) and (jit := jit_loops("pool_jit", xp, x)) is not None:
        y = ctx.out_contiguous(0)
        y = xp.empty((*x.shape[:2], *_out_hw(x, g)), x.dtype) if y is None else y
        jit.max_pool_planes(_planes(x), g["kernel"], g["stride"], g["padding"], _planes(y))
        return y
    padded, taps = _padded(xp, x, g), _taps(g, _out_hw(x, g))
    y = xp.array(padded[taps[0]], copy=True)
    for t in taps[1:]:
        xp.maximum(y, padded[t], out=y)
    return y


def _planes(a: Any) -> Any:
    """[N, C, H, W] as the planes [N*C, H, W] pool_jit's loops take (a view: a contiguous a)."""
    return a.reshape(-1, *a.shape[2:])


def _max_pool_grad_kernel(ctx: KernelContext, x: Any, dy: Any) -> Any:
    g = _geometry("max_pool2d_grad", ctx.attrs)
    fits = dy.shape == (*x.shape[:2], *_out_hw(x, g))  # the loops do not bounds-check; numpy raises
    if fits and (jit := jit_loops("pool_jit", ctx.xp, x, dy)) is not None:
        dx = ctx.out_contiguous(0)
        dx = ctx.xp.empty_like(x) if dx is None else dx
        jit.max_pool_grad_planes(_planes(x), _planes(dy), g["kernel"], g["stride"], g["padding"], _planes(dx))
        return dx
    return _max_pool_grad_numpy(ctx, x, dy)


def _max_pool_grad_numpy(ctx: KernelContext, x: Any, dy: Any) -> Any:
    # dy goes to the first maximum of each window (as torch), added where windows overlap: the taps in
    # row-major order, each taking the windows whose maximum it holds that no earlier tap took
    xp, g = ctx.xp, _geometry("max_pool2d_grad", ctx.attrs)
    padded, taps = _padded(xp, x, g), _taps(g, dy.shape[2:])
    y = _max_pool_kernel(ctx, x)
    dx = xp.zeros(padded.shape, dtype=dy.dtype)
    open_ = xp.ones(dy.shape, dtype=bool)  # windows whose maximum no tap has taken yet
    hit, share = xp.empty(dy.shape, dtype=bool), xp.empty_like(dy)
    for t in taps:
        xp.equal(padded[t], y, out=hit)
        xp.logical_and(hit, open_, out=hit)
        xp.logical_xor(open_, hit, out=open_)
        dx[t] += xp.multiply(dy, hit, out=share)
    (ph, pw), (h, w) = g["padding"], x.shape[2:]
    return xp.ascontiguousarray(dx[:, :, ph : ph + h, pw : pw + w])


defop(
    "max_pool2d",
    inputs=("x",),
    infer=_infer("max_pool2d"),
    rows=lambda m, a: _planes_rows(1),
    kernel=_max_pool_kernel,
    grad=lambda g: [g.call("max_pool2d_grad", g.inputs[0], g.dy, **g.attrs)],
    attrs=_POOL_ATTRS,
    doc="max over each kernel window of x [N, C, H, W] (padding counts as -inf)",
    flops=_window_flops,
)
defop(
    "max_pool2d_grad",
    inputs=("x", "dy"),
    outputs=("dx",),
    infer=_infer("max_pool2d_grad", backward=True),
    rows=lambda m, a: _planes_rows(2, (sig([B, P], [P]),)),  # linear in dy, given whole x
    kernel=_max_pool_grad_kernel,
    grad=NoGrad("backward op of max_pool2d"),
    attrs=_POOL_ATTRS,
    doc="gradient of max_pool2d: dy routed to each window's (first) maximum",
    flops=_window_flops,
)


# ---- avg_pool2d ----------------------------------------------------------------------------------


def _avg_pool_kernel(ctx: KernelContext, x: Any) -> Any:
    g = _geometry("avg_pool2d", ctx.attrs)
    if (jit := jit_loops("pool_jit", ctx.xp, x)) is not None:
        y = ctx.xp.empty((*x.shape[:2], *_out_hw(x, g)), dtype=x.dtype)
        jit.avg_pool_planes(_planes(x), g["kernel"], g["stride"], g["padding"], _planes(y))
        return y
    cols = windows(ctx.xp, x, g["kernel"], g)  # zero padding counted in the mean, as torch's default
    return ctx.xp.mean(cols, axis=(4, 5))


def _avg_pool_grad_kernel(ctx: KernelContext, dy: Any) -> Any:
    xp = ctx.xp
    g = _geometry("avg_pool2d_grad", ctx.attrs)
    kh, kw = g["kernel"]
    share = xp.broadcast_to((dy / (kh * kw))[..., None, None], (*dy.shape, kh, kw))
    x_shape = (*dy.shape[:2], *pair("avg_pool2d_grad", ctx.attrs, "input_hw", 1))
    return xp.ascontiguousarray(scatter_windows(xp, share, x_shape, g))


def _input_hw(g: GradContext) -> tuple[int, ...]:
    return tuple(g.in_metas[0].shape[2:])


defop(
    "avg_pool2d",
    inputs=("x",),
    infer=_infer("avg_pool2d"),
    rows=lambda m, a: _planes_rows(1, (sig([P], [P]),)),
    kernel=_avg_pool_kernel,
    grad=lambda g: [g.call("avg_pool2d_grad", g.dy, input_hw=_input_hw(g), **g.attrs)],
    attrs=_POOL_ATTRS,
    doc="mean over each kernel window of x [N, C, H, W], zero padding included in the count",
    flops=_window_flops,
)
defop(
    "avg_pool2d_grad",
    inputs=("dy",),
    outputs=("dx",),
    infer=_infer("avg_pool2d_grad", backward=True),
    rows=lambda m, a: _planes_rows(1, (sig([P], [P]),)),
    kernel=_avg_pool_grad_kernel,
    grad=NoGrad("backward op of avg_pool2d"),
    attrs={**_POOL_ATTRS, "input_hw": (1, 1)},
    doc="gradient of avg_pool2d: each dy spread evenly over its window",
    flops=_window_flops,
)


# ---- adaptive_avg_pool2d -------------------------------------------------------------------------


def _bins(xp: Any, size: int, out: int, dtype: Any) -> Any:
    """[out, size]: row i averages torch's bin [floor(i size / out), ceil((i + 1) size / out))."""
    m = xp.zeros((out, size), dtype=dtype)
    for i in range(out):
        lo, hi = (i * size) // out, -(-((i + 1) * size) // out)
        m[i, lo:hi] = 1.0 / (hi - lo)
    return m


def _adaptive_infer(op: str, backward: bool) -> Any:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        (x,) = metas
        check_float(op, x=x)
        if x.ndim != 4:
            raise ShapeError(f"op {op!r}: {'dy' if backward else 'x'} {x} must be [N, C, H, W]")
        key = "input_hw" if backward else "output_size"
        return (TensorMeta((*x.shape[:2], *pair(op, attrs, key, 1)), x.dtype),)

    return infer


def _adaptive_kernel(backward: bool) -> Any:
    def kernel(ctx: KernelContext, x: Any) -> Any:
        xp = ctx.xp
        oh, ow = pair("adaptive_avg_pool2d", ctx.attrs, "output_size", 1)
        h, w = pair("adaptive_avg_pool2d", ctx.attrs, "input_hw", 1) if backward else x.shape[2:]
        if (jit := jit_loops("pool_jit", xp, x)) is not None:
            out = xp.empty((*x.shape[:2], *((h, w) if backward else (oh, ow))), dtype=x.dtype)
            (jit.adaptive_avg_grad_planes if backward else jit.adaptive_avg_planes)(_planes(x), _planes(out))
            return out
        rows, cols = _bins(xp, h, oh, x.dtype), _bins(xp, w, ow, x.dtype)
        spec = "ncij,ih,jw->nchw" if backward else "nchw,ih,jw->ncij"
        return xp.ascontiguousarray(xp.einsum(spec, x, rows, cols))

    return kernel


defop(
    "adaptive_avg_pool2d",
    inputs=("x",),
    infer=_adaptive_infer("adaptive_avg_pool2d", False),
    rows=lambda m, a: _planes_rows(1, (sig([P], [P]),)),
    kernel=_adaptive_kernel(False),
    grad=lambda g: [
        g.call("adaptive_avg_pool2d_grad", g.dy, output_size=g.attrs["output_size"], input_hw=_input_hw(g))
    ],
    attrs={"output_size": (1, 1)},
    doc="mean over torch's adaptive bins of x [N, C, H, W] to [N, C, *output_size]",
    flops=1,
)
defop(
    "adaptive_avg_pool2d_grad",
    inputs=("dy",),
    outputs=("dx",),
    infer=_adaptive_infer("adaptive_avg_pool2d_grad", True),
    rows=lambda m, a: _planes_rows(1, (sig([P], [P]),)),
    kernel=_adaptive_kernel(True),
    grad=NoGrad("backward op of adaptive_avg_pool2d"),
    attrs={"output_size": (1, 1), "input_hw": (1, 1)},
    doc="gradient of adaptive_avg_pool2d: each dy spread evenly over its bin",
    flops=1,
)
