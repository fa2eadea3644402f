"""Masks, selection, dropout and creation: ops that need more than the values of their inputs.

``causal_mask`` and ``dropout`` read where their shard lies (global offsets from the kernel context), so
they give the same numbers on any layout; ``full`` has no inputs and fills whatever shard a rank holds.
"""

from __future__ import annotations

from typing import Any

from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import REQUIRED, Attrs, GradContext, KernelContext, Metas, Signature, defop
from sbpflow.ops.elementwise import (
    Grads,
    broadcast_shapes,
    check_bool,
    check_kind,
    check_scalar,
    fill_value,
    same_dtype,
    same_shape_rows,
    scalar_of,
    unbroadcast,
)
from sbpflow.random import RandomKey, bernoulli_mask, dropout_jit
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta

# ---- masks and selection ----------------------------------------------------------------------------------


def _masked_fill_infer(metas: Metas, attrs: Attrs) -> Metas:
    x, mask = metas
    check_bool("masked_fill", "mask", mask)
    check_scalar("masked_fill", "value", attrs["value"], x.dtype)
    if broadcast_shapes("masked_fill", metas) != x.shape:
        raise ShapeError(
            f"op 'masked_fill' needs mask {list(mask.shape)} to broadcast to x {list(x.shape)} without "
            "growing x; drop or size-1 the mask's extra axes"
        )
    return (x,)


defop(
    "masked_fill",
    inputs=("x", "mask"),
    attrs={"value": REQUIRED},
    infer=_masked_fill_infer,
    # filling with 0 is linear in x (the backward's case); any other value is affine, so no P
    rows=lambda m, a: rows.broadcasting(m, m[0].ndim, linear=(a["value"] == 0, False)),
    kernel=lambda ctx, x, mask: ctx.xp.where(mask, fill_value(ctx.xp, x.dtype, ctx.attrs["value"]), x),
    grad=lambda g: [g.call("masked_fill", g.dy, g.inputs[1], value=0.0), None],
    doc="x with value where mask (broadcast to x) is True",
    flops=1,
)


def _causal_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    check_kind("causal_mask", "x", x, "floating")
    if x.ndim < 2:
        raise ShapeError(f"op 'causal_mask' needs x of shape [..., Tq, Tk], got {x}; add the query axis")
    return (x,)


def _causal_kernel(ctx: KernelContext, x: Any) -> Any:
    xp, nd = ctx.xp, x.ndim
    q0, k0 = ctx.in_offset(0, nd - 2), ctx.in_offset(0, nd - 1)  # global offsets of this shard
    q = xp.arange(q0, q0 + x.shape[-2]).reshape(-1, 1)
    k = xp.arange(k0, k0 + x.shape[-1]).reshape(1, -1)
    out = x.copy()  # then fill: half the time of xp.where, which selects element by element
    xp.copyto(out, fill_value(xp, x.dtype, ctx.attrs["value"]), where=k > q)
    return out


defop(
    "causal_mask",
    inputs=("x",),
    # -1e30, not -inf: a row with every key masked would softmax to nan with -inf; -1e30 is clamped to the
    # dtype's lowest finite value where it does not fit (float16)
    attrs={"value": -1e30},
    infer=_causal_infer,
    # any axis may split, the query and key axes too: the kernel masks by global offsets
    rows=lambda m, a: rows.elementwise(m, linear=(a["value"] == 0,)),
    kernel=_causal_kernel,
    grad=lambda g: [g.call("causal_mask", g.dy, value=0.0)],
    doc="x [..., Tq, Tk] with value where key index > query index",
    flops=1,
)


def _where_infer(metas: Metas, attrs: Attrs) -> Metas:
    cond, a, b = metas
    check_bool("where", "cond", cond)
    same_dtype("where", ("a", "b"), a, b)
    return (TensorMeta(broadcast_shapes("where", metas), a.dtype),)


def _where_grad(g: GradContext) -> Grads:
    cond = g.inputs[0]
    not_cond = g.call("eq_scalar", cond, value=0.0)
    da = g.call("masked_fill", g.dy, not_cond, value=0.0)
    db = g.call("masked_fill", g.dy, cond, value=0.0)
    return [None, unbroadcast(g, da, 1), unbroadcast(g, db, 2)]


defop(
    "where",
    inputs=("cond", "a", "b"),
    infer=_where_infer,
    # linear in (a, b) together: P in both with the same cond picks a share of one of them per element
    rows=lambda m, a: [
        *rows.broadcasting(m, max(x.ndim for x in m)),
        Signature((B, P, P), (P,)),
    ],
    kernel=lambda ctx, cond, a, b: ctx.xp.where(cond, a, b),
    grad=_where_grad,
    doc="a where cond else b, with numpy broadcasting",
    flops=1,
)


# ---- random and creation ----------------------------------------------------------------------------------


def _dropout_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    check_kind("dropout", "x", x, "floating")
    rate, rng_id = attrs["rate"], attrs["rng_id"]
    if not 0.0 <= float(rate) < 1.0:  # type: ignore[arg-type]
        raise ShapeError(f"op 'dropout' needs 0 <= rate < 1, got rate={rate}; rate=0 disables it")
    if not isinstance(rng_id, int) or not 0 <= rng_id < 2**32:
        raise ShapeError(
            f"op 'dropout' needs rng_id in [0, 2**32), got {rng_id!r}; see sf.random.tensor_rng_id"
        )
    return (x,)


def _dropout_kernel(ctx: KernelContext, x: Any) -> Any:
    rate = float(ctx.attrs["rate"])  # type: ignore[arg-type]
    if rate == 0.0:
        return x.copy()
    key = RandomKey(seed=ctx.seed, tensor_id=int(ctx.attrs["rng_id"]), step=ctx.step)  # type: ignore[arg-type]
    # keyed on the logical shape and this shard's place in it: the same mask whatever the layout, and the
    # same on every rank of a P or B tensor
    if (y := dropout_jit(x, key, ctx.out_metas[0].shape, ctx.out_index[0], 1.0 - rate)) is not None:
        return y  # the same bits, in one pass (random_jit.py)
    keep = bernoulli_mask(ctx.xp, key, ctx.out_metas[0].shape, ctx.out_index[0], keep_prob=1.0 - rate)
    return x * (keep.astype(x.dtype) * scalar_of(x.dtype, 1.0 / (1.0 - rate)))


defop(
    "dropout",
    inputs=("x",),
    attrs={"rate": REQUIRED, "rng_id": REQUIRED},
    infer=_dropout_infer,
    rows=same_shape_rows((True,)),  # x * fixed mask is linear in x
    kernel=_dropout_kernel,
    grad=lambda g: [g.call("dropout", g.dy, **g.attrs)],  # regenerates the forward's mask
    random=True,
    doc="x * keep / (1 - rate), keep ~ Bernoulli(1 - rate) from (seed, rng_id, step)",
    flops=4,  # a Philox draw, a compare and a scale
)


def _full_infer(metas: Metas, attrs: Attrs) -> Metas:
    shape, dtype = attrs["shape"], as_dtype(attrs["dtype"])
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ShapeError(f"op 'full' needs shape as a tuple of non-negative ints, got {shape!r}")
    if dtype is not DType.bool:
        check_scalar("full", "value", attrs["value"], dtype)
    return (TensorMeta(shape, dtype),)  # type: ignore[arg-type]


def _full_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    """No input to agree with: replicate, or let each rank fill its own shard of any axis."""
    ndim = len(attrs["shape"])  # type: ignore[arg-type]
    return [Signature((), (B,)), *(Signature((), (Split(i),)) for i in range(ndim))]


def _full_kernel(ctx: KernelContext) -> Any:
    shape, dtype = ctx.out_shape(0), ctx.out_dtype()
    if not shape:  # a 0-d fill (a loss scale, a step count): asarray, a quarter of full's time
        return ctx.xp.asarray(ctx.attrs["value"], dtype=dtype)
    return ctx.xp.full(shape, ctx.attrs["value"], dtype=dtype)


defop(
    "full",
    inputs=(),
    attrs={"shape": REQUIRED, "dtype": DType.float32, "value": 0.0},
    infer=_full_infer,
    rows=_full_rows,
    kernel=_full_kernel,
    grad=lambda g: [],  # no inputs, so no input gradients (it is differentiable: nothing flows back)
    doc="a tensor of shape and dtype filled with value",
    flops=0,
)
