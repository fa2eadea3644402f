"""Reductions and their inverses: sum, mean, max over axes; sum_to and broadcast_to (numpy broadcasting).

Rows: a split of a kept axis stays a split (of the output axis it lands on once reduced axes are
dropped); a split of a reduced axis leaves each rank a partial result, so the linear reductions (sum,
mean) give ``P`` there and max gives no row. ``P`` passes through the linear ones.

The gradients of sum and mean re-insert the reduced axes and broadcast (``sum_grad``/``mean_grad``):
``broadcast_to`` alone cannot, because with ``keepdims=False`` the reduced axes may sit between kept
ones and numpy broadcasting only adds leading axes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from math import prod
from typing import Any

import numpy as np

from sbpflow.dtype import DType
from sbpflow.errors import ShapeError
from sbpflow.ops.base import (
    REQUIRED,
    SHAPE_CACHE_SIZE,
    Attrs,
    GradContext,
    KernelContext,
    Metas,
    NoGrad,
    Signature,
    defop,
    sig,
)
from sbpflow.ops.kernels.rowwise import jit_loops, jit_rows
from sbpflow.ops.rows import all_broadcast
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import Shape, TensorMeta


def normalize_axes(op: str, ndim: int, axes: Any, what: str = "x") -> tuple[int, ...]:
    """``axes`` (None = all, an int, or a tuple; negatives count from the end) as sorted non-negative ints."""
    if axes is None:
        return tuple(range(ndim))
    raw = (axes,) if isinstance(axes, int) else tuple(axes)
    out = []
    for a in raw:
        if not -ndim <= a < ndim:
            raise ShapeError(
                f"op {op!r}: axis {a} is out of range for {what} with ndim {ndim}; "
                f"use an axis in {-ndim}..{ndim - 1}"
            )
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ShapeError(f"op {op!r}: axes {raw} name an axis twice for {what} with ndim {ndim}")
    return tuple(sorted(out))


def reduced_shape(shape: Shape, axes: tuple[int, ...], keepdims: bool) -> Shape:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def kept_axis_map(ndim: int, axes: tuple[int, ...], keepdims: bool) -> dict[int, int]:
    """Input axis -> output axis for every axis a reduction keeps."""
    kept = [i for i in range(ndim) if i not in axes]
    return {i: (i if keepdims else j) for j, i in enumerate(kept)}


def _reduce_rows(op: str, linear: bool) -> Callable[[Metas, Attrs], list[Signature]]:
    def rows(metas: Metas, attrs: Attrs) -> list[Signature]:
        ndim = metas[0].ndim
        axes = normalize_axes(op, ndim, attrs["axes"])
        out = [sig([Split(i)], [Split(j)]) for i, j in kept_axis_map(ndim, axes, attrs["keepdims"]).items()]
        if linear:
            out += [sig([Split(i)], [P]) for i in axes]  # each rank sums its slice: partial sums
            out.append(sig([P], [P]))
        return [*out, all_broadcast(1, 1)]

    return rows


# ---- sum, mean, max ------------------------------------------------------------------------------


def _check_dtype(op: str, x: TensorMeta) -> None:
    allowed = {"sum": x.dtype != DType.bool, "mean": x.dtype.is_floating, "max": True}[op]
    if not allowed:
        fix = "a float dtype" if op == "mean" else "an int or float dtype"
        raise ShapeError(f"op {op!r} does not take x of dtype {x.dtype.value}; cast x to {fix} first")


def _reduce_infer(op: str) -> Callable[[Metas, Attrs], Metas]:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        (x,) = metas
        _check_dtype(op, x)
        axes = normalize_axes(op, x.ndim, attrs["axes"])
        return (TensorMeta(reduced_shape(x.shape, axes, bool(attrs["keepdims"])), x.dtype),)

    return infer


@lru_cache(maxsize=SHAPE_CACHE_SIZE)
def _axes_cached(op: str, ndim: int, axes: Any) -> tuple[int, ...]:
    return normalize_axes(op, ndim, axes)


def kernel_axes(op: str, ndim: int, axes: Any) -> tuple[int, ...]:
    """normalize_axes, remembered for a kernel's (op, ndim, axes): its Python loop ran on every call, a
    tenth of a small sum's time. Attrs arrive as tuples (normalize_attrs); a list is normalised afresh."""
    try:
        return _axes_cached(op, ndim, axes)
    except TypeError:  # unhashable axes
        return normalize_axes(op, ndim, axes)


def sum_all(xp: Any, x: Any, keepdims: bool = False) -> Any | None:
    """The sum of every element of float ``x`` as the ``sum`` kernel makes it (one loop over the whole
    array), or None where that kernel takes another path; :mod:`sbpflow.ops.fused`'s ``sum_squares``
    calls it directly, with the same bits."""
    jit = jit_rows(xp, x)
    if jit is None:
        return None
    y = np.empty((1,) * x.ndim if keepdims else (), dtype=x.dtype)
    jit.sum_all(x, y)
    return y


def _sum_kernel(ctx: KernelContext, x: Any) -> Any:
    axes, keep = kernel_axes("sum", x.ndim, ctx.attrs["axes"]), bool(ctx.attrs["keepdims"])
    if len(axes) == x.ndim and (y := sum_all(ctx.xp, x, keep)) is not None:  # a whole array: one loop
        return y
    if ctx.xp is np and x.dtype.kind == "f":
        # np.sum's Python wrapper around this ufunc reduction took half the time of a small sum
        return np.asarray(np.add.reduce(x, axis=axes, keepdims=keep))  # type: ignore[call-overload]
    y = ctx.xp.sum(x, axis=axes, keepdims=keep)
    return ctx.xp.asarray(y).astype(ctx.out_dtype(), copy=False)  # int sums widen in numpy


def _but_channels(ndim: int, axes: tuple[int, ...]) -> bool:
    """Whether ``axes`` are every axis but 1 (the channels) of an array of ``ndim`` >= 3: batch norm's
    statistics (``F.batch_norm``'s mean), which norm_jit's plane loops reduce and broadcast."""
    return ndim >= 3 and axes == (0, *range(2, ndim))


def _channel_mean(ctx: KernelContext, x: Any, count: int) -> Any | None:
    """The mean over every axis but the channels by norm_jit's float64 plane sums (one vectorised pass;
    numpy's strided sum over (0, 2, 3) did not vectorise), or None where the loops do not take x. Not
    numpy's bits: a float64 sum, rounded once to the output's dtype (float32 at least as close to the
    exact mean as numpy's pairwise float32 sum)."""
    if (jit := jit_loops("norm_jit", ctx.xp, x)) is None:
        return None
    sums = np.empty(x.shape[1], np.float64)
    jit.channel_sums(x.reshape(x.shape[0], x.shape[1], -1), sums)
    y = (sums / count).astype(ctx.out_dtype())
    return y.reshape(_with_ones(x.shape, (0, *range(2, x.ndim)))) if ctx.attrs["keepdims"] else y


def _mean_kernel(ctx: KernelContext, x: Any) -> Any:
    axes, keep = kernel_axes("mean", x.ndim, ctx.attrs["axes"]), bool(ctx.attrs["keepdims"])
    count = prod(ctx.in_metas[0].shape[a] for a in axes)  # the LOGICAL count: partial means add up
    if _but_channels(x.ndim, axes) and (y := _channel_mean(ctx, x, count)) is not None:
        return y
    y = ctx.xp.sum(x, axis=axes, keepdims=keep)
    y = y / count
    return ctx.xp.asarray(y).astype(ctx.out_dtype(), copy=False)


def _max_kernel(ctx: KernelContext, x: Any) -> Any:
    axes, keep = kernel_axes("max", x.ndim, ctx.attrs["axes"]), bool(ctx.attrs["keepdims"])
    xp = ctx.xp
    if axes == (x.ndim - 1,) and (jit := jit_rows(xp, x)) is not None:  # one vectorised pass a row
        y = xp.empty(x.shape[:-1] + (1,) * keep, x.dtype)
        jit.max_rows(x.reshape(-1, x.shape[-1]), y.reshape(-1))
        return y
    if xp.__name__ == "numpy" and len(axes) == 1 and x.shape[axes[0]] > 0:
        # numpy's argmax is vectorised, its max along an axis is not: the same value, ~3x sooner
        y = xp.take_along_axis(x, xp.argmax(x, axis=axes[0], keepdims=True), axis=axes[0])
        return y if keep else y.squeeze(axes[0])
    return xp.asarray(xp.max(x, axis=axes, keepdims=keep))  # a full reduction gives a scalar


def _unreduce_grad(op: str) -> Callable[[GradContext], list[Any]]:
    def grad(g: GradContext) -> list[Any]:
        x = g.in_metas[0]
        axes = normalize_axes(op, x.ndim, g.attrs["axes"])
        keep = bool(g.attrs["keepdims"])
        if op == "max":
            return [g.call("max_grad", g.dy, g.inputs[0], g.outputs[0], axes=axes, keepdims=keep)]
        return [g.call(f"{op}_grad", g.dy, shape=x.shape, axes=axes, keepdims=keep)]

    return grad


# op -> (linear, fp32, kernel, doc); fp32: computes in fp32 under mixed precision, since a sum of many
# terms loses its small addends in fp16
_REDUCTIONS = {
    "sum": (True, True, _sum_kernel, "sum over axes (None = all); S on a reduced axis gives P"),
    "mean": (
        True,
        True,
        _mean_kernel,
        "mean over axes (None = all); divides by the logical count, so S(reduced) gives P",
    ),
    "max": (
        False,
        False,
        _max_kernel,
        "max over axes (None = all); no P: a max of partial sums is not the max of the sum",
    ),
}

for _op, (_linear, _fp32, _kernel_fn, _doc) in _REDUCTIONS.items():
    defop(
        _op,
        inputs=("x",),
        infer=_reduce_infer(_op),
        rows=_reduce_rows(_op, _linear),
        kernel=_kernel_fn,
        grad=_unreduce_grad(_op),
        attrs={"axes": None, "keepdims": False},
        doc=_doc,
        flops=1,
        fp32=_fp32,
    )


# ---- backward ops of the reductions --------------------------------------------------------------


def _unreduce_infer(op: str) -> Callable[[Metas, Attrs], Metas]:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        dy = metas[0]
        shape = tuple(attrs["shape"])
        axes = normalize_axes(op, len(shape), attrs["axes"])
        want = reduced_shape(shape, axes, bool(attrs["keepdims"]))
        if dy.shape != want:
            raise ShapeError(
                f"op {op!r}: dy has shape {list(dy.shape)} but reducing {list(shape)} over axes {axes} "
                f"gives {list(want)}; pass the forward input's shape and axes"
            )
        return (TensorMeta(shape, dy.dtype),)

    return infer


def _unreduce_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    shape = tuple(attrs["shape"])
    axes = normalize_axes("sum_grad/mean_grad", len(shape), attrs["axes"])
    kept = kept_axis_map(len(shape), axes, bool(attrs["keepdims"]))
    rows = [sig([Split(j)], [Split(i)]) for i, j in kept.items()]
    rows += [sig([B], [Split(i)]) for i in axes]  # dy is constant along a reduced axis: expand a slice
    return [*rows, sig([P], [P]), all_broadcast(1, 1)]


def broadcast_into(ctx: KernelContext, x: Any, shape: Shape) -> Any:
    """``x`` broadcast to this rank's output, in a fresh array or the runtime's dead one
    (``KernelContext.out_array``): one copy, without broadcast_to's view and ``.copy()`` around it."""
    out = ctx.out_array(0)
    if out is None:
        out = ctx.xp.empty(ctx.out_shape(), dtype=x.dtype)
    ctx.xp.copyto(out, x.reshape(shape))
    return out


@lru_cache(maxsize=SHAPE_CACHE_SIZE)
def _with_ones(shape: Shape, axes: tuple[int, ...]) -> Shape:
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _expand(ctx: KernelContext, dy: Any, axes: tuple[int, ...]) -> Any:
    """``dy`` with the reduced axes back as size 1 (local shapes), broadcast to this rank's output."""
    return broadcast_into(ctx, dy, _with_ones(ctx.out_shape(), axes))


def _sum_grad_kernel(ctx: KernelContext, dy: Any) -> Any:
    return _expand(ctx, dy, kernel_axes("sum_grad", len(ctx.out_metas[0].shape), ctx.attrs["axes"]))


def _mean_grad_kernel(ctx: KernelContext, dy: Any) -> Any:
    shape = ctx.out_metas[0].shape
    axes = kernel_axes("mean_grad", len(shape), ctx.attrs["axes"])
    scaled = dy / dy.dtype.type(prod(shape[a] for a in axes))
    if _but_channels(len(shape), axes) and (jit := jit_loops("norm_jit", ctx.xp, scaled)) is not None:
        local = ctx.out_shape()  # batch norm's mean: each channel's value filled into its planes
        dx = ctx.out_contiguous(0)
        dx = np.empty(local, scaled.dtype) if dx is None else dx
        jit.fill_planes(scaled.reshape(-1), dx.reshape(local[0], local[1], -1))
        return dx  # the same copy as _expand's, a plane at a time: the same bits
    return _expand(ctx, scaled, axes)


for _op, _kernel in (("sum_grad", _sum_grad_kernel), ("mean_grad", _mean_grad_kernel)):
    defop(
        _op,
        inputs=("dy",),
        outputs=("dx",),
        infer=_unreduce_infer(_op),
        rows=_unreduce_rows,
        kernel=_kernel,
        grad=NoGrad(f"backward op of {_op[:-5]}"),
        attrs={"shape": REQUIRED, "axes": None, "keepdims": False},
        doc=f"gradient of {_op[:-5]}: re-insert the reduced axes of dy and broadcast to `shape`",
        flops=1,
    )


def _max_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, x, y = metas
    axes = normalize_axes("max_grad", x.ndim, attrs["axes"])
    want = reduced_shape(x.shape, axes, bool(attrs["keepdims"]))
    if dy.shape != want or y.shape != want:
        raise ShapeError(
            f"op 'max_grad': dy {list(dy.shape)} and y {list(y.shape)} must both be {list(want)}, "
            f"the max of x {list(x.shape)} over axes {axes}"
        )
    return (x,)


def _max_grad_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    x = metas[1]
    axes = normalize_axes("max_grad", x.ndim, attrs["axes"])
    kept = kept_axis_map(x.ndim, axes, bool(attrs["keepdims"]))
    # a split reduced axis would need the ties on other ranks: no row for it
    rows = [sig([Split(j), Split(i), Split(j)], [Split(i)]) for i, j in kept.items()]
    return [*rows, sig([P, B, B], [P]), all_broadcast(3, 1)]  # linear in dy


def _max_grad_kernel(ctx: KernelContext, dy: Any, x: Any, y: Any) -> Any:
    # Ties share the gradient evenly (as torch.amax does): the sum over x of dx is dy either way, and
    # the rule is symmetric, so it does not depend on the layout.
    axes = normalize_axes("max_grad", x.ndim, ctx.attrs["axes"])
    with_ones = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    hit = (x == y.reshape(with_ones)).astype(x.dtype)
    count = ctx.xp.sum(hit, axis=axes, keepdims=True)
    return hit * (dy.reshape(with_ones) / count)


defop(
    "max_grad",
    inputs=("dy", "x", "y"),
    outputs=("dx",),
    infer=_max_grad_infer,
    rows=_max_grad_rows,
    kernel=_max_grad_kernel,
    grad=NoGrad("backward op of max"),
    attrs={"axes": None, "keepdims": False},
    doc="gradient of max: dy goes to the maxima of x, split evenly among ties",
    flops=1,
)


# ---- sum_to and broadcast_to: numpy broadcasting and its inverse ---------------------------------


def _check_broadcastable(op: str, small: Shape, big: Shape, names: tuple[str, str]) -> None:
    lead = len(big) - len(small)
    if lead < 0 or any(s not in (1, big[lead + k]) for k, s in enumerate(small)):
        raise ShapeError(
            f"op {op!r}: {names[0]} {list(small)} does not broadcast to {names[1]} {list(big)}; each "
            f"trailing size of {list(small)} must be 1 or equal the aligned size of {list(big)}"
        )


def _sum_to_axes(x_shape: Shape, shape: Shape) -> tuple[int, ...]:
    """The axes of ``x`` that ``sum_to`` sums: the leading extra ones and those where ``shape`` has 1."""
    lead = len(x_shape) - len(shape)
    return tuple(range(lead)) + tuple(lead + k for k, s in enumerate(shape) if s == 1)


def _sum_to_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    shape = tuple(attrs["shape"])
    _check_dtype("sum", x)
    _check_broadcastable("sum_to", shape, x.shape, ("shape", "x"))
    return (TensorMeta(shape, x.dtype),)


def _sum_to_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    x = metas[0]
    shape = tuple(attrs["shape"])
    lead = x.ndim - len(shape)
    axes = _sum_to_axes(x.shape, shape)
    kept = [sig([Split(i)], [Split(i - lead)]) for i in range(x.ndim) if i not in axes]
    return [*kept, *(sig([Split(i)], [P]) for i in axes), sig([P], [P]), all_broadcast(1, 1)]


@lru_cache(maxsize=SHAPE_CACHE_SIZE)
def _rows_of(x_shape: Shape, shape: Shape, local: Shape) -> tuple[int, int] | None:
    """``(rows, n)`` where sum_to of a local ``local`` sums every leading axis and nothing else (a bias
    gradient: the sum of the rows of ``[rows, n]``), else None. Depends on shapes alone, so it is worked
    out once per shape, not on every call."""
    lead = len(local) - len(shape)
    if not lead or _sum_to_axes(x_shape, shape) != tuple(range(lead)):
        return None
    return prod(local[:lead]), prod(local[lead:])


def _sum_to_kernel(ctx: KernelContext, x: Any) -> Any:
    xp, out_shape = ctx.xp, ctx.out_shape()
    rows = _rows_of(ctx.in_metas[0].shape, tuple(ctx.attrs["shape"]), x.shape)
    if rows is not None and x.dtype.kind == "f":
        flat = x.reshape(rows)
        if (jit := jit_rows(xp, flat)) is not None:  # one vectorised pass (rows_jit.py)
            out = xp.empty(rows[1], dtype=x.dtype)
            jit.sum_rows(flat, out)
            return out.reshape(out_shape)
        return xp.einsum("r...->...", flat).reshape(out_shape)  # one pass, ~half of xp.sum's time
    axes = _sum_to_axes(ctx.in_metas[0].shape, tuple(ctx.attrs["shape"]))
    y = xp.sum(x, axis=axes, keepdims=True).reshape(out_shape)
    return y.astype(ctx.out_dtype(), copy=False)


defop(
    "sum_to",
    inputs=("x",),
    infer=_sum_to_infer,
    rows=_sum_to_rows,
    kernel=_sum_to_kernel,
    grad=lambda g: [g.call("broadcast_to", g.dy, shape=g.in_metas[0].shape)],
    attrs={"shape": REQUIRED},
    doc="sum x down to `shape` (the inverse of numpy broadcasting); the gradient of broadcasting ops",
    flops=1,
)


def _broadcast_to_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    shape = tuple(attrs["shape"])
    _check_broadcastable("broadcast_to", x.shape, shape, ("x", "shape"))
    return (TensorMeta(shape, x.dtype),)


def _broadcast_to_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    x = metas[0]
    shape = tuple(attrs["shape"])
    lead = len(shape) - x.ndim
    rows = []
    for j, d in enumerate(shape):
        a = j - lead
        if a >= 0 and x.shape[a] == d:
            rows.append(sig([Split(a)], [Split(j)]))
        else:  # x is constant along j: every rank expands its own slice of the output
            rows.append(sig([B], [Split(j)]))
    return [*rows, sig([P], [P]), all_broadcast(1, 1)]


@lru_cache(maxsize=SHAPE_CACHE_SIZE)
def _broadcast_strides(shape: Shape, itemsize: int, out: Shape) -> tuple[int, ...] | None:
    """The strides of a C-contiguous ``shape`` broadcast to ``out``: 0 along every axis it is constant.
    None where ``shape`` does not broadcast to ``out`` (np.broadcast_to then says why)."""
    lead = len(out) - len(shape)
    if lead < 0 or any(s not in (1, out[lead + a]) for a, s in enumerate(shape)):
        return None
    own = [itemsize * prod(shape[a + 1 :]) for a in range(len(shape))]
    return tuple(0 if j < lead or shape[j - lead] != d else own[j - lead] for j, d in enumerate(out))


def _broadcast_to_kernel(ctx: KernelContext, x: Any) -> Any:
    """A read-only view on numpy, no copy (PyTorch's expand is one too: a fresh copy of the MLP's
    activation was 15x its time). The runtime allows one: what writes into an array checks that it may
    (a donation needs it writeable, ``OutputReuse`` keeps only arrays that own their memory), and a
    view holds its base, so x's buffer is not lent while the view lives. Made from x's buffer with
    strides worked out once per shape: np.broadcast_to's Python took 1.8 us, this 0.6. cupy has no
    read-only flag that a writer could check: it keeps the copy."""
    if ctx.xp is not np:
        return broadcast_into(ctx, x, x.shape)
    out = ctx.out_shape()
    strides = _broadcast_strides(x.shape, x.itemsize, out) if x.flags.c_contiguous else None
    if strides is None:
        return np.broadcast_to(x, out)
    y = np.ndarray(out, x.dtype, x, 0, strides)
    y.flags.writeable = False
    return y


defop(
    "broadcast_to",
    inputs=("x",),
    infer=_broadcast_to_infer,
    rows=_broadcast_to_rows,
    kernel=_broadcast_to_kernel,
    grad=lambda g: [g.call("sum_to", g.dy, shape=g.in_metas[0].shape)],
    attrs={"shape": REQUIRED},
    doc="numpy broadcast of x to `shape`; on numpy a read-only view of x, as PyTorch's expand",
    flops=0,
    view=True,
)
