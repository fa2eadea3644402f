"""Batch norm's ops: ``running_stat``, the next value of a running mean or variance, and the per-channel
passes of ``F.batch_norm`` (``channel_var``, ``channel_affine`` and their gradients, below).

    y = (1 - momentum) * running + momentum * scale * batch_stat

as PyTorch's BatchNorm updates ``running_mean`` (scale 1) and ``running_var`` (scale n / (n - 1): the
unbiased variance of the n values each channel's batch statistic was taken over). The op computes a
value; that it is the variable's value for the next step is the compiler's ``running_stats`` pass, which
reads the op's first input as the variable it updates (and the one-device oracle does the same).

Rows: elementwise on same-shape inputs. The map is linear in ``(running, batch_stat)`` jointly, so
``P, P -> P`` holds (sum over ranks of the parts' updates is the update of the sums); ``P`` in one input
with the other ``B`` does not (the ``B`` input would be counted once per rank).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import REQUIRED, Attrs, GradContext, KernelContext, Metas, NoGrad, Signature, defop
from sbpflow.ops.elementwise import check_kind, same_dtype
from sbpflow.ops.kernels.rowwise import jit_loops
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta


def _infer(metas: Metas, attrs: Attrs) -> Metas:
    running, stat = metas
    check_kind("running_stat", "running", running, "floating")
    same_dtype("running_stat", ("running", "batch_stat"), running, stat)
    if running.shape != stat.shape:
        raise ShapeError(
            f"op 'running_stat' needs one shape for 'running' {list(running.shape)} and 'batch_stat' "
            f"{list(stat.shape)}; reshape the batch statistic to the running one's shape"
        )
    if not 0.0 <= float(attrs["momentum"]) <= 1.0:
        raise ShapeError(f"op 'running_stat' momentum={attrs['momentum']}: use a value in [0, 1]")
    return (running,)


def _rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    return [*rows.elementwise(metas), Signature((P, P), (P,))]  # linear in both inputs at once


def _kernel(ctx: KernelContext, running: Any, stat: Any) -> Any:
    xp, m = ctx.xp, float(ctx.attrs["momentum"])
    dt = running.dtype.type
    y = xp.multiply(stat, dt(m * float(ctx.attrs["scale"])))
    return xp.add(y, xp.multiply(running, dt(1.0 - m)), out=y)


defop(
    "running_stat",
    inputs=("running", "batch_stat"),
    infer=_infer,
    rows=_rows,
    kernel=_kernel,
    grad=NoGrad("a running statistic is state carried between steps, not on any path to the loss"),
    attrs={"momentum": REQUIRED, "scale": 1.0},
    doc="(1 - momentum) * running + momentum * scale * batch_stat: batch norm's running statistics",
    flops=3,
    fp32=True,  # an fp32 variable's next value
)


# ---- batch norm's passes -------------------------------------------------------------------------------
#
# F.batch_norm is y = (x - mean) * scale + shift per channel (channel_affine), scale = weight / sqrt(var +
# eps) and shift = bias computed on [C]; the mean is the ``mean`` op's and the variance is centred on it
# (channel_var: one pass, no temporary). The gradients: one pass for the two sums of scale and shift
# (channel_affine_grad), one a term of dx. Centred, as the composite these replace: E[x^2] - E[x]^2 lost
# the variance of a channel of few values close together (torchvision's ResNet at 1x1, batch 2). Both
# statistics are means over the batch, so an S(0) x gives partial means P, which the compiler all-reduces
# where the [C] maths reads them: synchronised batch norm, as before.


def _channels(op: str, x: TensorMeta) -> int:
    if x.ndim < 2:
        raise ShapeError(f"op {op!r}: x {x} needs a channel axis 1: give it as [N, C, ...]")
    return x.shape[1]


def _per_channel(op: str, x: TensorMeta, *same: tuple[str, TensorMeta], **params: TensorMeta) -> None:
    """x floating [N, C, ...], each of ``same`` x's meta, each of ``params`` [C] of x's dtype."""
    check_kind(op, "x", x, "floating")
    for name, m in same:
        if m != x:
            raise ShapeError(f"op {op!r}: {name} {m} must have x's shape and dtype {x}")
    for name, m in params.items():
        same_dtype(op, ("x", name), x, m)
        if m.shape != (_channels(op, x),):
            raise ShapeError(
                f"op {op!r}: {name} {m} must be [C] = [{x.shape[1]}], one value per channel of x {x}"
            )


def _count(meta: TensorMeta) -> int:
    """The values a channel's statistic is taken over: the LOGICAL shape's, so partial means add up."""
    return max(1, meta.numel // max(1, meta.shape[1]))


def _planes(a: Any) -> Any:
    return a.reshape(a.shape[0], a.shape[1], -1)  # [N, C, S]: a view of a contiguous a


def _at(x: Any, c: Any) -> Any:
    """A [C] array as [1, C, 1, ...], to broadcast along x's axis 1."""
    return c.reshape(1, x.shape[1], *(1,) * (x.ndim - 2))


def _sums_rows(ndim: int, n_in: int, n_b: int, n_out: int) -> list[Signature]:
    """n_in tensors like x split alike on d and n_b [C] inputs B (or split on the channels with them): a
    channel split gives split sums, any other partial sums."""
    return [
        *(Signature((Split(d),) * n_in + (B,) * n_b, (P,) * n_out) for d in range(ndim) if d != 1),
        Signature((Split(1),) * n_in + (Split(0),) * n_b, (Split(0),) * n_out),
        rows.all_broadcast(n_in + n_b, n_out),
    ]


def _map_rows(ndim: int, n_b: int, linear: tuple[Signature, ...]) -> list[Signature]:
    """x split on d with its n_b [C] inputs B, or split with them on the channels: y split as x."""
    return [
        *(Signature((Split(d),) + (B,) * n_b, (Split(d),)) for d in range(ndim) if d != 1),
        Signature((Split(1),) + (Split(0),) * n_b, (Split(1),)),
        *linear,
        rows.all_broadcast(1 + n_b, 1),
    ]


def _var_infer(metas: Metas, attrs: Attrs) -> Metas:
    x, mean = metas
    _per_channel("channel_var", x, mean=mean)
    return (mean,)


def _var_kernel(ctx: KernelContext, x: Any, mean: Any) -> Any:
    xp, count = ctx.xp, _count(ctx.in_metas[0])
    if (jit := jit_loops("norm_jit", xp, x, mean)) is not None:
        squares = np.empty(x.shape[1])
        jit.centred_squares(_planes(x), mean, squares)
    else:
        d = _planes(xp.subtract(x, _at(x, mean), dtype=xp.float64))
        squares = xp.einsum("ncs,ncs->c", d, d)
    return (squares / count).astype(x.dtype)


defop(
    "channel_var",
    inputs=("x", "mean"),
    outputs=("var",),
    infer=_var_infer,
    rows=lambda m, a: _sums_rows(m[0].ndim, 1, 1, 1),
    kernel=_var_kernel,
    grad=lambda g: list(g.call_n("channel_var_grad", *g.inputs, g.dy)),
    doc="each channel's mean of (x - mean)^2 over every axis but 1 (x [N, C, ...], mean [C]), one pass",
    flops=3,
    fp32=True,
)


def _var_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    x, mean, dvar = metas
    _per_channel("channel_var_grad", x, mean=mean, dvar=dvar)
    return (x, mean)


def _var_grad_kernel(ctx: KernelContext, x: Any, mean: Any, dvar: Any) -> tuple[Any, Any]:
    # dx = 2 (x - mean) dvar / count; dmean = -2 sum(x - mean) dvar / count (0 where mean is x's own)
    xp, count = ctx.xp, _count(ctx.in_metas[0])
    k = 2 * dvar / x.dtype.type(count)
    if (jit := jit_loops("norm_jit", xp, x, mean, k)) is not None:
        dx, total = ctx.out_contiguous(0), np.empty(x.shape[1])
        dx = xp.empty_like(x) if dx is None else dx
        jit.centred_affine_sum(_planes(x), mean, k, _planes(dx), total)
    else:
        d = xp.subtract(x, _at(x, mean))
        dx, total = d * _at(x, k), xp.sum(d, axis=tuple(a for a in range(x.ndim) if a != 1), dtype=xp.float64)
    return dx, (-total * k).astype(x.dtype)


defop(
    "channel_var_grad",
    inputs=("x", "mean", "dvar"),
    outputs=("dx", "dmean"),
    infer=_var_grad_infer,
    rows=lambda m, a: [
        *(Signature((Split(d), B, B), (Split(d), P)) for d in range(m[0].ndim) if d != 1),
        Signature((Split(1), Split(0), Split(0)), (Split(1), Split(0))),
        Signature((B, B, P), (P, P)),  # linear in dvar
        Signature((P, P, B), (P, P)),  # and in (x, mean) jointly
        rows.all_broadcast(3, 2),
    ],
    kernel=_var_grad_kernel,
    grad=NoGrad("backward op of channel_var"),
    doc="gradient of channel_var: dx = 2 (x - mean) dvar / count and dmean = -2 sum(x - mean) dvar / count",
    flops=3,
    fp32=True,
)


def _affine_infer(metas: Metas, attrs: Attrs) -> Metas:
    x, mean, scale, shift = metas
    _per_channel("channel_affine", x, mean=mean, scale=scale, shift=shift)
    return (x,)


def _affine(ctx: KernelContext, x: Any, mean: Any, scale: Any, shift: Any) -> Any:
    """(x - mean) * scale + shift by channel: one pass where the loops take the arrays."""
    if (jit := jit_loops("norm_jit", ctx.xp, x, mean, scale, shift)) is not None:
        y = ctx.out_contiguous(0)  # the memory plan's dead buffer, or a new array
        y = ctx.xp.empty_like(x) if y is None else y
        jit.centred_affine(_planes(x), mean, scale, shift, _planes(y))
        return y
    return (x - _at(x, mean)) * _at(x, scale) + _at(x, shift)


def _affine_grad(g: GradContext) -> list[Any]:
    x, mean, scale, _ = g.inputs
    dscale, dshift = g.call_n("channel_affine_grad", g.dy, x, mean)
    zero = g.call("full", shape=g.in_metas[1].shape, dtype=g.in_metas[1].dtype, value=0.0)
    dmean = g.call("neg", g.call("mul", dshift, scale))
    return [g.call("channel_affine", g.dy, zero, scale, zero), dmean, dscale, dshift]


defop(
    "channel_affine",
    inputs=("x", "mean", "scale", "shift"),
    infer=_affine_infer,
    # linear in (x, mean, shift) jointly given B scale, and in (scale, shift) given B x and mean
    rows=lambda m, a: _map_rows(m[0].ndim, 3, (Signature((P, P, B, P), (P,)), Signature((B, B, P, P), (P,)))),
    kernel=_affine,
    grad=_affine_grad,
    doc="(x - mean) * scale + shift, each [C] along x's axis 1 (x [N, C, ...]): batch norm's map, one pass",
    flops=3,
)


def _affine_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, x, mean = metas
    _per_channel("channel_affine_grad", x, ("dy", dy), mean=mean)
    return (mean, mean)


def _affine_grad_kernel(ctx: KernelContext, dy: Any, x: Any, mean: Any) -> tuple[Any, Any]:
    xp = ctx.xp
    if (jit := jit_loops("norm_jit", xp, dy, x, mean)) is not None:
        dot, total = np.empty(x.shape[1]), np.empty(x.shape[1])
        jit.centred_dot_sum(_planes(dy), _planes(x), mean, dot, total)
    else:
        dot = xp.einsum("ncs,ncs->c", _planes(dy), _planes(xp.subtract(x, _at(x, mean), dtype=xp.float64)))
        total = xp.sum(dy, axis=tuple(a for a in range(x.ndim) if a != 1), dtype=xp.float64)
    return dot.astype(x.dtype), total.astype(x.dtype)


defop(
    "channel_affine_grad",
    inputs=("dy", "x", "mean"),
    outputs=("dscale", "dshift"),
    infer=_affine_grad_infer,
    rows=lambda m, a: [
        *_sums_rows(m[0].ndim, 2, 1, 2),
        Signature((P, B, B), (P, P)),  # linear in dy, given whole x and mean
        Signature((B, P, P), (P, B)),  # sum(dy (x - mean)) linear in (x, mean); sum(dy) whole
    ],
    kernel=_affine_grad_kernel,
    grad=NoGrad("backward op of channel_affine"),
    doc="gradient of channel_affine's scale and shift: each channel's sum of dy (x - mean) and of dy",
    flops=3,
    fp32=True,
)


# ---- the fused backward (control_plane/compiler/passes/bn_grad.py) --------------------------------------
#
# channel_var_grad's dmean alone (its dx is folded into channel_input_grad) and the input gradient
# dy * scale + (x - mean) * 2 dvar / count + dmean / count in one pass: the sum of channel_affine's dx
# (mean and shift zero), channel_var_grad's dx and mean_grad's broadcast, each in x's dtype.


def _var_dmean_infer(metas: Metas, attrs: Attrs) -> Metas:
    x, mean, dvar = metas
    _per_channel("channel_var_dmean", x, mean=mean, dvar=dvar)
    return (mean,)


def _var_dmean_kernel(ctx: KernelContext, x: Any, mean: Any, dvar: Any) -> Any:
    xp, count = ctx.xp, _count(ctx.in_metas[0])
    k = 2 * dvar / x.dtype.type(count)
    if (jit := jit_loops("norm_jit", xp, x, mean)) is not None:
        total = np.empty(x.shape[1])
        jit.centred_sums(_planes(x), mean, total)
    else:
        axes = tuple(a for a in range(x.ndim) if a != 1)
        total = xp.sum(xp.subtract(x, _at(x, mean), dtype=xp.float64), axis=axes)
    return (-total * k).astype(x.dtype)


defop(
    "channel_var_dmean",
    inputs=("x", "mean", "dvar"),
    outputs=("dmean",),
    infer=_var_dmean_infer,
    rows=lambda m, a: [
        *(Signature((Split(d), B, B), (P,)) for d in range(m[0].ndim) if d != 1),
        Signature((Split(1), Split(0), Split(0)), (Split(0),)),
        Signature((B, B, P), (P,)),  # linear in dvar
        Signature((P, P, B), (P,)),  # and in (x, mean) jointly
        rows.all_broadcast(3, 1),
    ],
    kernel=_var_dmean_kernel,
    grad=NoGrad("backward op of channel_var"),
    doc="channel_var_grad's dmean alone: -2 sum(x - mean) dvar / count per channel, one read of x",
    flops=2,
    fp32=True,
)


def _input_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, x, mean, scale, dvar, dmean = metas
    _per_channel("channel_input_grad", x, ("dy", dy), mean=mean, scale=scale, dvar=dvar, dmean=dmean)
    return (x,)


def _input_grad_kernel(ctx: KernelContext, dy: Any, x: Any, *cs: Any) -> Any:
    xp, dt = ctx.xp, x.dtype.type
    mean, scale, dvar, dmean = cs
    count = dt(_count(ctx.in_metas[1]))
    k, d = 2 * dvar / count, dmean / count
    if (jit := jit_loops("norm_jit", xp, dy, x, mean, scale, k, d)) is not None:
        dx = ctx.out_contiguous(0)
        dx = xp.empty_like(x) if dx is None else dx
        jit.input_grad(_planes(dy), _planes(x), mean, scale, k, d, _planes(dx))
        return dx
    return dy * _at(x, scale) + (x - _at(x, mean)) * _at(x, k) + _at(x, d)


defop(
    "channel_input_grad",
    inputs=("dy", "x", "mean", "scale", "dvar", "dmean"),
    outputs=("dx",),
    infer=_input_grad_infer,
    rows=lambda m, a: [
        *(Signature((Split(d), Split(d), B, B, B, B), (Split(d),)) for d in range(m[0].ndim) if d != 1),
        Signature((Split(1), Split(1), *(Split(0),) * 4), (Split(1),)),
        rows.all_broadcast(6, 1),
    ],
    kernel=_input_grad_kernel,
    grad=NoGrad("backward op of batch norm (channel_affine, channel_var and mean)"),
    doc="batch norm's dx in one pass: dy scale + (x - mean) 2 dvar / count + dmean / count, by channel",
    flops=6,
)
