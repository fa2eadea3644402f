"""Scaled dot-product attention as one op: ``attention`` and its backward op ``attention_grad``.

``softmax(mask(q k^T * scale)) v`` was five ops forward (batch_matmul, mul_scalar, causal_mask, softmax,
batch_matmul; client/functional.py) and seven backward, each an act of the engine (~6.5 us of overhead)
and most of them a pass over the ``[B, H, Tq, Tk]`` scores. Here the forward is two GEMMs and one pass over
the scores (attention_jit.py: scale, mask and softmax in place), and the backward four GEMMs and one pass
(the softmax's gradient, masked and scaled). The probabilities are the forward's second output, saved for
the backward as the unfused softmax's output was. The main job (2 layers) went from 307 to 287 acts a
step; on its [16, 4, 64, 16] heads the kernels of one layer's forward and backward took ~0.5x the CPU
time of the unfused ops' kernels (2.8 against 5.5 ms, load ~2.5).

The kernels run the unfused kernels' operations in their order, on numpy (the GEMMs are the same
``matmul`` calls); only the row sums add in another order than rows_jit's vectorised ones, so a result is
within a few ulp of the unfused graph's (float64: ~1e-15 on the GPT's shapes; tested to 1e-12).

Rows (q, k, v ``[..., T, D]``, equal leading axes; the last two are the query/key axis and the feature
axis): split any leading axis (batch S(0), heads S(1)) alike everywhere; split the queries of q, y and the
probabilities with k and v whole (the causal mask reads the query shard's global offset, as causal_mask
did); split v's features, which only y has; ``P`` through v, in which y is linear. Never a split of the key
axis or of q and k's features: the softmax needs every score of a row. The backward takes the same, each
with the partial sums it makes (a query shard gives partial dk and dv; a feature shard of v, partial dq
and dk), q and k split by features together, and ``P`` through dy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sbpflow.errors import ShapeError
from sbpflow.ops.base import REQUIRED, Attrs, GradContext, KernelContext, Metas, NoGrad, Signature, defop, sig
from sbpflow.ops.elementwise import fill_value
from sbpflow.ops.kernels.rowwise import jit_loops
from sbpflow.ops.nn import check_floats
from sbpflow.ops.rows import all_broadcast
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta

MASK_FILL = -1e30  # causal_mask's default: exp() of it is 0 beside any real score (-inf would nan a row)


def _infer(metas: Metas, attrs: Attrs) -> Metas:
    q, k, v = metas
    check_floats("attention", q=q, k=k, v=v)
    if (
        q.ndim < 2
        or not q.ndim == k.ndim == v.ndim
        or not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
        or q.shape[-1] != k.shape[-1]
        or k.shape[-2] != v.shape[-2]
    ):
        raise ShapeError(
            f"op 'attention' needs q [..., Tq, Dh], k [..., Tk, Dh] and v [..., Tk, Dv] with equal leading "
            f"axes, got q {q}, k {k}, v {v}; it does not broadcast, so expand the operands first"
        )
    lead, tq, tk = q.shape[:-2], q.shape[-2], k.shape[-2]
    return TensorMeta((*lead, tq, v.shape[-1]), q.dtype), TensorMeta((*lead, tq, tk), q.dtype)


def _rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    nd = metas[0].ndim
    qa, fa = Split(nd - 2), Split(nd - 1)
    return [
        *(sig([Split(i)] * 3, [Split(i)] * 2) for i in range(nd - 2)),
        sig([qa, B, B], [qa, qa]),  # a query shard: its rows of y and of the probabilities
        sig([B, B, fa], [fa, B]),  # v's features: y's
        sig([B, B, P], [P, B]),  # y is linear in v
        all_broadcast(3, 2),
    ]


def _grad_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    nd = metas[0].ndim
    qa, fa = Split(nd - 2), Split(nd - 1)
    return [
        *(sig([Split(i)] * 5, [Split(i)] * 3) for i in range(nd - 2)),
        sig([qa, B, B, qa, qa], [qa, P, P]),  # dk, dv sum over the queries: this shard's share
        sig([B, B, fa, B, fa], [P, P, fa]),  # dy v^T sums over v's features: partial scores' gradient
        sig([fa, fa, B, B, B], [fa, fa, B]),  # dq = ds k, dk = ds^T q: per feature
        sig([B, B, B, B, P], [P, P, P]),  # linear in dy
        all_broadcast(5, 3),
    ]


def _t(xp: Any, x: Any) -> Any:
    return xp.swapaxes(x, -1, -2)


def _mm(xp: Any, a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` as batch_matmul's kernel computes it (linalg._gemm): in their dtype, into ``out`` where
    the runtime lends one; numpy's bfloat16 matmul returns float32, rounded back."""
    if out is not None and out.dtype == a.dtype == b.dtype and a.dtype != "bfloat16":
        return xp.matmul(a, b, out=out)
    y = xp.matmul(a, b)
    return y if y.dtype == a.dtype else y.astype(a.dtype)


def _heads_inside(ctx: KernelContext, i: int) -> Any:
    """Output ``i`` ([B, H, T, D]) for a GEMM to write: an array laid out [B, T, H, D] in memory, so the
    model's ``transpose(1, 2)`` back to [B, T, H, D] is C-contiguous and its reshape to [B, T, H * D] (the
    forward) or the gradient's concat into the fused qkv projection's rows (the backward) moves no
    strided bytes: the main job's reshape copied each layer's y and its concat, strided, wrote a strided
    result that the next reshape copied again. Other ranks keep the lent buffer. The GEMM's values do not
    depend on where it writes (numpy's BLAS call takes the strides)."""
    lent, shape = ctx.out_array(i), ctx.out_shape(i)
    if len(shape) != 4 or ctx.xp is not np:
        return lent
    b, h, t, d = shape
    dtype = np.dtype(ctx.out_dtype(i))
    strides = tuple(dtype.itemsize * s for s in (t * h * d, d, h * d, 1))
    if lent is not None and lent.strides == strides:  # its own previous output
        return lent
    if lent is not None and lent.flags.c_contiguous:  # a planned buffer: the same bytes, in the other order
        return lent.reshape(b, t, h, d).transpose(0, 2, 1, 3)
    # an array that owns its memory, which the runtime lends back next step (a transpose's view it does not)
    return np.ndarray(shape, dtype, strides=strides)


def _query_offset(ctx: KernelContext) -> int:
    """Where this rank's query rows start in the whole sequence (0 unless the query axis is split)."""
    return ctx.in_offset(0, ctx.in_metas[0].ndim - 2)


def _causal_where(xp: Any, s: Any, q0: int) -> Any:
    """Where key index > query index on scores ``s [..., tq, tk]`` whose queries start at ``q0``."""
    q = xp.arange(q0, q0 + s.shape[-2]).reshape(-1, 1)
    return xp.arange(s.shape[-1]).reshape(1, -1) > q


def _softmax_numpy(xp: Any, s: Any, scale: float, causal: bool, q0: int) -> Any:
    """The unfused kernels' numpy formulas (cupy, float16, bfloat16): s * scale, the mask, then
    e / sum(e), e = exp(x - max x), in place on s."""
    s = xp.multiply(s, s.dtype.type(scale), out=s)
    if causal:
        xp.copyto(s, fill_value(xp, s.dtype, MASK_FILL), where=_causal_where(xp, s, q0))
    s = xp.subtract(s, xp.max(s, axis=-1, keepdims=True), out=s)
    s = xp.exp(s, out=s)
    return xp.divide(s, xp.sum(s, axis=-1, keepdims=True), out=s)


def _softmax_grad_numpy(xp: Any, p: Any, dp: Any, scale: float, causal: bool, q0: int) -> Any:
    """(dp - sum(dp p)) p, masked to 0, times scale, in place on dp."""
    dp = xp.subtract(dp, xp.sum(xp.multiply(dp, p), axis=-1, keepdims=True), out=dp)
    dp = xp.multiply(dp, p, out=dp)
    if causal:
        xp.copyto(dp, fill_value(xp, dp.dtype, 0.0), where=_causal_where(xp, dp, q0))
    return xp.multiply(dp, dp.dtype.type(scale), out=dp)


def _args(ctx: KernelContext, s: Any) -> tuple[float, bool, int, int]:
    return float(ctx.attrs["scale"]), bool(ctx.attrs["causal"]), s.shape[-2], _query_offset(ctx)


def forward(ctx: KernelContext, q: Any, k: Any, v: Any, probs: Any, y: Any) -> tuple[Any, Any]:
    """y and the probabilities of ``q``, ``k``, ``v`` (any strides), written into ``probs`` and ``y``
    where they are arrays (None: allocated); the attention core (attention_core.py) shares it."""
    xp = ctx.xp
    s = _mm(xp, q, _t(xp, k), probs)  # the scores, then the probabilities in place
    scale, causal, tq, q0 = _args(ctx, s)
    if (loops := jit_loops("attention_jit", xp, s)) is not None:
        loops.softmax_scores(s.reshape(-1, s.shape[-1]), scale, causal, tq, q0)
    else:
        s = _softmax_numpy(xp, s, scale, causal, q0)
    return _mm(xp, s, v, y), s


def backward(ctx: KernelContext, q: Any, k: Any, v: Any, p: Any, dy: Any, outs: Any) -> tuple[Any, Any, Any]:
    """dq, dk, dv, written into ``outs`` (three arrays or Nones), as :func:`forward`."""
    xp = ctx.xp
    ds = _mm(xp, dy, _t(xp, v))  # the probabilities' gradient, then the scores' in place
    scale, causal, tq, q0 = _args(ctx, ds)
    if p.shape == ds.shape and (loops := jit_loops("attention_jit", xp, p, ds)) is not None:
        loops.softmax_scores_grad(
            p.reshape(-1, p.shape[-1]), ds.reshape(-1, ds.shape[-1]), scale, causal, tq, q0
        )
    else:
        ds = _softmax_grad_numpy(xp, p, ds, scale, causal, q0)
    dq = _mm(xp, ds, k, outs[0])
    dk = _mm(xp, _t(xp, ds), q, outs[1])
    return dq, dk, _mm(xp, _t(xp, p), dy, outs[2])


def _kernel(ctx: KernelContext, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    return forward(ctx, q, k, v, ctx.out_array(1), _heads_inside(ctx, 0))


def _grad_kernel(ctx: KernelContext, q: Any, k: Any, v: Any, p: Any, dy: Any) -> tuple[Any, Any, Any]:
    return backward(ctx, q, k, v, p, dy, [_heads_inside(ctx, i) for i in range(3)])


def _grad(g: GradContext) -> list[Any]:
    """attention_grad from y's gradient; a gradient of the probabilities too (a caller that reads them)
    goes through the unfused backward ops and is added to dq and dk."""
    q, k, v = g.inputs
    probs = g.outputs[1]
    dy, dprobs = g.grads
    if dy is None:  # only the probabilities take a gradient
        dy = g.grads_or_zeros()[0]
    attrs = {"scale": g.attrs["scale"], "causal": g.attrs["causal"]}
    dq, dk, dv = g.call_n("attention_grad", q, k, v, probs, dy, **attrs)
    if dprobs is not None:
        ds = g.call("softmax_grad", probs, dprobs, axis=-1)
        if g.attrs["causal"]:
            ds = g.call("causal_mask", ds, value=0.0)
        ds = g.call("mul_scalar", ds, value=g.attrs["scale"])
        dq = g.call("add", dq, g.call("batch_matmul", ds, k))
        dk = g.call("add", dk, g.call("batch_matmul", ds, q, transpose_a=True))
    return [dq, dk, dv]


def _score_count(ins: Metas) -> int:
    q, k = ins[0], ins[1]
    return q.numel // q.shape[-1] * k.shape[-2]  # [..., Tq, Tk]


def _flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    # q k^T and p v (2 n d each), then ~7 a score: scale, mask, max, subtract, exp, sum, divide
    n, dh, dv = _score_count(ins), ins[0].shape[-1], ins[2].shape[-1]
    return n * (2 * dh + 2 * dv + 7)


def _grad_flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    # dy v^T, ds k, ds^T q and p^T dy (2 n d each), then ~5 a score: product, sum, subtract, product, scale
    n, dh, dv = _score_count(ins), ins[0].shape[-1], ins[2].shape[-1]
    return n * (4 * dh + 4 * dv + 5)


def _grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    q, k, v, probs, dy = metas
    y, p = _infer((q, k, v), attrs)
    if probs != p or dy != y:
        raise ShapeError(
            f"op 'attention_grad' needs probs {p} and dy {y} for q {q}, k {k}, v {v}; got probs {probs} "
            f"and dy {dy}: pass the forward's second output and its output's gradient"
        )
    return q, k, v


ATTRS = {"scale": REQUIRED, "causal": False}

defop(
    "attention",
    inputs=("q", "k", "v"),
    outputs=("y", "probs"),
    attrs=ATTRS,
    infer=_infer,
    rows=_rows,
    kernel=_kernel,
    grad=_grad,
    doc="y = probs v, probs = softmax(q k^T * scale, keys after the query masked where causal), with "
    "q [..., Tq, Dh], k [..., Tk, Dh], v [..., Tk, Dv]",
    flops=_flops,
    fp32=True,  # the softmax's exp overflows fp16, and its sum loses small terms (as softmax)
)

defop(
    "attention_grad",
    inputs=("q", "k", "v", "probs", "dy"),
    outputs=("dq", "dk", "dv"),
    attrs=ATTRS,
    infer=_grad_infer,
    rows=_grad_rows,
    kernel=_grad_kernel,
    grad=NoGrad("backward op of attention"),
    doc="dq, dk, dv of attention from its inputs, its probabilities and y's gradient dy",
    flops=_grad_flops,
    fp32=True,
)
