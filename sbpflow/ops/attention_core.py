"""The attention core with its heads' layout as one op: ``qkv_attention`` and ``qkv_attention_grad``.

The GPT block (client/nn/transformer.py) takes q, k and v from its fused projection ``qkv [B, T, 3 H Dh]``
as nanoGPT-with-Megatron's layout lays them: ``reshape [B, T, H, 3, Dh]``, ``split`` on the "3" axis,
three ``reshape [B, T, H, Dh]`` and three ``transpose (0, 2, 1, 3)`` to ``[B, H, T, Dh]``; after
``attention``, ``transpose`` and ``reshape`` back to ``y [B, T, H Dh]``. Autodiff mirrors each of them,
and ``concat`` joins dq, dk and dv into the projection's gradient: 11 ops forward and 11 backward a layer
around one attention and one attention_grad, each an act of the engine (~11-18 us). The compiler's fold
(control_plane/compiler/attention_core.py) makes them these two ops, which read q, k and v as strided
views of qkv and write y, and dq, dk and dv, straight into their places in ``[B, T, H Dh]`` and
``[B, T, 3 H Dh]``: the same GEMMs and softmax passes as attention.py's kernels (its ``forward`` and
``backward``), on the views the unfused transposes made, without the concat's copy.

``head_dim`` (Dh), not the number of heads, is the attribute: a rank holding a column shard of qkv holds
whole heads (Megatron's layout) and finds how many from its local shape.

Rows: the batch split (S(0) everywhere); the heads split (qkv and y S(2), the probabilities S(1)), as
attention's rows on the heads axis with the layout ops' own; ``P`` through dy backward (it is linear in
dy). Never the sequence: the fold leaves a sequence-split attention as it is.
"""

from __future__ import annotations

from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops import attention
from sbpflow.ops.base import REQUIRED, Attrs, FlopFn, KernelContext, Metas, NoGrad, defop, sig
from sbpflow.ops.nn import check_floats
from sbpflow.ops.rows import all_broadcast
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta


def _heads(op: str, qkv: TensorMeta, attrs: Attrs) -> int:
    d = int(attrs["head_dim"])  # type: ignore[arg-type]
    if qkv.ndim != 3 or d < 1 or qkv.shape[2] % (3 * d):
        raise ShapeError(
            f"op '{op}' needs qkv [B, T, 3 H Dh] with head_dim Dh={d} dividing a third of its last axis, got "
            f"qkv {qkv}; pass the fused projection's output and its heads' width"
        )
    return qkv.shape[2] // (3 * d)


def _infer(metas: Metas, attrs: Attrs) -> Metas:
    (qkv,) = metas
    check_floats("qkv_attention", qkv=qkv)
    h = _heads("qkv_attention", qkv, attrs)
    b, t, _ = qkv.shape
    return TensorMeta((b, t, h * int(attrs["head_dim"])), qkv.dtype), TensorMeta((b, h, t, t), qkv.dtype)  # type: ignore[arg-type]


def _grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    qkv, probs, dy = metas
    y, p = _infer((qkv,), attrs)
    if probs != p or dy != y:
        raise ShapeError(
            f"op 'qkv_attention_grad' needs probs {p} and dy {y} for qkv {qkv}; got probs {probs} and dy "
            f"{dy}: pass the forward's second output and its output's gradient"
        )
    return (qkv,)


def _split(x: Any, d: int, parts: int) -> tuple[Any, ...]:
    """``x [B, T, H parts Dh]`` as ``parts`` views ``[B, H, T, Dh]`` (part i of each head's columns)."""
    b, t, w = x.shape
    grouped = x.reshape(b, t, w // (parts * d), parts, d)
    return tuple(grouped[:, :, :, i].transpose(0, 2, 1, 3) for i in range(parts))


def _out(ctx: KernelContext, i: int) -> Any:
    """Output ``i`` ([B, T, W]) to write into: the lent buffer where it is C-contiguous, else new."""
    out = ctx.out_contiguous(i)
    return ctx.xp.empty(ctx.out_shape(i), ctx.out_dtype(i)) if out is None else out


def _into(views: tuple[Any, ...], results: tuple[Any, ...]) -> None:
    """Copy a result that the GEMM did not write into its view (bfloat16, or a dtype it returned
    anew: attention._mm)."""
    for view, r in zip(views, results, strict=True):
        if r is not view:
            view[...] = r


def _kernel(ctx: KernelContext, qkv: Any) -> tuple[Any, Any]:
    d = int(ctx.attrs["head_dim"])  # type: ignore[arg-type]
    q, k, v = _split(ctx.xp.ascontiguousarray(qkv), d, 3)
    y = _out(ctx, 0)
    heads = _split(y, d, 1)
    out, probs = attention.forward(ctx, q, k, v, ctx.out_array(1), heads[0])
    _into(heads, (out,))
    return y, probs


def _grad_kernel(ctx: KernelContext, qkv: Any, p: Any, dy: Any) -> Any:
    xp, d = ctx.xp, int(ctx.attrs["head_dim"])  # type: ignore[arg-type]
    q, k, v = _split(xp.ascontiguousarray(qkv), d, 3)
    dx = _out(ctx, 0)
    parts = _split(dx, d, 3)
    _into(parts, attention.backward(ctx, q, k, v, p, _split(xp.ascontiguousarray(dy), d, 1)[0], parts))
    return dx


def _rows(n_in: int, n_out: int, heads: tuple[tuple[Any, ...], tuple[Any, ...]]) -> list[Any]:
    return [sig([Split(0)] * n_in, [Split(0)] * n_out), sig(*heads), all_broadcast(n_in, n_out)]


def _flops(per_score: tuple[int, int]) -> FlopFn:
    """attention's count on [B, H, T, Dh] q, k and v: ``per_score[0]`` Dh + ``per_score[1]`` a score."""

    def count(ins: Metas, outs: Metas, attrs: Attrs) -> int:
        b, t, w = ins[0].shape
        d = int(attrs["head_dim"])  # type: ignore[arg-type]
        return b * (w // 3 // d) * t * t * (per_score[0] * d + per_score[1])

    return count


ATTRS = {"head_dim": REQUIRED, "scale": REQUIRED, "causal": False}

defop(
    "qkv_attention",
    inputs=("qkv",),
    outputs=("y", "probs"),
    attrs=ATTRS,
    infer=_infer,
    rows=lambda m, a: _rows(1, 2, ((Split(2),), (Split(2), Split(1)))),
    kernel=_kernel,
    grad=NoGrad("made by the compiler's attention-core fold, after autodiff"),
    even_splits=True,  # a rank's columns of qkv are whole heads
    doc="attention over the heads of qkv [B, T, 3 H Dh] laid out [B, T, H, 3, Dh]: y [B, T, H Dh] and the "
    "probabilities [B, H, T, T], as reshape, split, reshape, transpose, attention, transpose, reshape",
    flops=_flops((4, 7)),  # q k^T and p v, then the softmax's pass (attention's)
    fp32=True,
)

defop(
    "qkv_attention_grad",
    inputs=("qkv", "probs", "dy"),
    outputs=("dqkv",),
    attrs=ATTRS,
    infer=_grad_infer,
    rows=lambda m, a: [
        *_rows(3, 1, ((Split(2), Split(1), Split(2)), (Split(2),))),
        sig([B, B, P], [P]),  # linear in dy
    ],
    kernel=_grad_kernel,
    grad=NoGrad("backward op of qkv_attention"),
    even_splits=True,
    doc="the gradient of qkv_attention's qkv from qkv, its probabilities and y's gradient dy",
    flops=_flops((8, 5)),  # four products, then the softmax gradient's pass (attention_grad's)
    fp32=True,
)
