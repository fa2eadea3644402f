"""Logistic and erf activations: sigmoid, GELU in its tanh form (``gelu``, GPT-2's) and exact
(``gelu_erf``, PyTorch's default) with their backward ops, and binary cross-entropy with logits. Both
GELUs run elementwise_jit.py's one-pass loops where they take the arrays; the numpy kernels here are
the reference and cupy's path.

Rows: the activations are elementwise and nonlinear, so any axis may be split alike and nothing takes
``P``; the GELUs' backward ops are linear in ``dy``.
"""

from __future__ import annotations

import math
from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import Attrs, GradContext, KernelContext, Metas, NoGrad, Signature, defop
from sbpflow.ops.elementwise import check_kind, cube, grad_infer, jit_elementwise, owned, same_dtype
from sbpflow.ops.kernels.erf import erf
from sbpflow.ops.kernels.rowwise import jit_loops
from sbpflow.sbp import P, Split
from sbpflow.tensor_meta import TensorMeta

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _float_unary(op: str) -> Any:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        check_kind(op, "x", metas[0], "floating")
        return (metas[0],)

    return infer


# ---- sigmoid -------------------------------------------------------------------------------------


def sigmoid(xp: Any, x: Any) -> Any:
    """1 / (1 + exp(-x)) without overflow: with e = exp(-|x|) in (0, 1], 1 / (1 + e) where x >= 0 and
    e / (1 + e) where x < 0 (exp(-x) of a large negative x would overflow to inf)."""
    e = xp.abs(x)
    e = xp.exp(xp.negative(e, out=e), out=e)
    den = xp.add(e, x.dtype.type(1), out=owned(xp, x))
    num = xp.where(x >= 0, x.dtype.type(1), e)
    return xp.divide(num, den, out=den)


def _sigmoid_kernel(ctx: KernelContext, x: Any) -> Any:
    y = jit_elementwise(ctx, "sigmoid_all", x)  # one pass (elementwise_jit.py), into a lent buffer
    return sigmoid(ctx.xp, x) if y is None else y


def _sigmoid_grad(g: GradContext) -> list[Any]:
    y = g.outputs[0]  # d sigmoid = y (1 - y)
    return [g.call("mul", g.dy, g.call("mul", y, g.call("rsub_scalar", y, value=1.0)))]


defop(
    "sigmoid",
    inputs=("x",),
    infer=_float_unary("sigmoid"),
    rows=lambda m, a: rows.elementwise(m),
    kernel=_sigmoid_kernel,
    grad=_sigmoid_grad,
    doc="1 / (1 + exp(-x)), in a form that overflows for no x",
    flops=4,  # transcendental: fvcore counts a handful
)


# ---- GELU, tanh form ------------------------------------------------------------------------------

_GELU_C = math.sqrt(2.0 / math.pi)


def _gelu_tanh(xp: Any, x: Any, out: Any = None) -> Any:
    """tanh(sqrt(2/pi) (x + 0.044715 x^3)) in one array the kernel owns (or ``out``), in the formula's
    order."""
    t = cube(xp, x, out)
    t = xp.multiply(t, 0.044715, out=t)
    t = xp.add(t, x, out=t)
    t = xp.multiply(t, _GELU_C, out=t)
    return xp.tanh(t, out=t)


def _gelu_kernel(ctx: KernelContext, x: Any) -> Any:
    if (y := jit_elementwise(ctx, "gelu_tanh_all", x)) is not None:
        return y
    # 0.5 x (1 + t) as ((1 + t) x) 0.5: the same bits (a product is commutative and halving is exact)
    xp = ctx.xp
    y = _gelu_tanh(xp, x, ctx.out_array(0))
    y = xp.add(y, 1.0, out=y)
    y = xp.multiply(y, x, out=y)
    return xp.multiply(y, 0.5, out=y)


def _gelu_grad_kernel(ctx: KernelContext, dy: Any, x: Any) -> Any:
    """dy (0.5 (1 + t) + 0.5 x (1 - t^2) C (1 + 3 * 0.044715 x x)), each term in the formula's order,
    in three arrays the kernel owns."""
    if (g := jit_elementwise(ctx, "gelu_tanh_grad_all", dy, x)) is not None:
        return g
    xp = ctx.xp
    t = _gelu_tanh(xp, x, ctx.out_array(0))
    poly = xp.multiply(x, 3 * 0.044715, out=owned(xp, x))  # (0.134145 x) x + 1
    poly = xp.multiply(poly, x, out=poly)
    poly = xp.add(poly, 1.0, out=poly)
    b = xp.multiply(t, t, out=owned(xp, x))  # 1 - t t
    b = xp.subtract(1.0, b, out=b)
    # ((0.5 x)(1 - t t)) C as ((1 - t t) x) (C / 2): the same bits, as halving is exact (no underflow)
    b = xp.multiply(b, x, out=b)
    b = xp.multiply(b, _GELU_C / 2, out=b)
    b = xp.multiply(b, poly, out=b)
    t = xp.add(t, 1.0, out=t)  # 0.5 (1 + t), then + b, then times dy
    t = xp.multiply(t, 0.5, out=t)
    t = xp.add(t, b, out=t)
    return xp.multiply(t, dy, out=t)


defop(
    "gelu",
    inputs=("x",),
    infer=_float_unary("gelu"),
    rows=lambda m, a: rows.elementwise(m),
    kernel=_gelu_kernel,
    grad=lambda g: [g.call("gelu_grad", g.dy, g.inputs[0])],
    doc="GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))",
    flops=8,
)
defop(  # gelu's derivative reads its input x
    "gelu_grad",
    inputs=("dy", "x"),
    infer=grad_infer("gelu_grad", "x"),
    rows=lambda m, a: rows.elementwise(m, linear=(True, False)),  # linear in dy
    kernel=_gelu_grad_kernel,
    grad=NoGrad("backward op of gelu"),
    doc="dy times the derivative of gelu",
    flops=12,
)


# ---- exact GELU ----------------------------------------------------------------------------------


def _phi_cdf(xp: Any, x: Any) -> Any:
    """0.5 (1 + erf(x / sqrt 2)): the standard normal CDF, in an array the kernel owns."""
    c = erf(xp, xp.multiply(x, x.dtype.type(_SQRT_HALF)))
    c = xp.add(c, x.dtype.type(1), out=c)
    return xp.multiply(c, x.dtype.type(0.5), out=c)


def _gelu_erf_kernel(ctx: KernelContext, x: Any) -> Any:
    xp = ctx.xp
    if (y := jit_elementwise(ctx, "gelu_erf_all", x)) is not None:  # one pass (elementwise_jit.py)
        return y
    return xp.multiply(_phi_cdf(xp, x), x, out=owned(xp, x))


def _gelu_erf_grad_kernel(ctx: KernelContext, dy: Any, x: Any) -> Any:
    """dy (Phi(x) + x phi(x)), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)."""
    xp = ctx.xp
    if (g := jit_elementwise(ctx, "gelu_erf_grad_all", dy, x)) is not None:  # one pass
        return g
    d = xp.multiply(x, x, out=owned(xp, x))
    d = xp.exp(xp.multiply(d, x.dtype.type(-0.5), out=d), out=d)
    d = xp.multiply(d, x.dtype.type(_INV_SQRT_2PI), out=d)
    d = xp.multiply(d, x, out=d)
    d = xp.add(d, _phi_cdf(xp, x), out=d)
    return xp.multiply(d, dy, out=d)


def _gelu_erf_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, x = metas
    check_kind("gelu_erf_grad", "x", x, "floating")
    same_dtype("gelu_erf_grad", ("dy", "x"), dy, x)
    if dy.shape != x.shape:
        raise ShapeError(f"op 'gelu_erf_grad' needs dy and x of one shape, got {dy} and {x}")
    return (x,)


defop(
    "gelu_erf",
    inputs=("x",),
    infer=_float_unary("gelu_erf"),
    rows=lambda m, a: rows.elementwise(m),
    kernel=_gelu_erf_kernel,
    grad=lambda g: [g.call("gelu_erf_grad", g.dy, g.inputs[0])],
    doc="exact GELU, x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (PyTorch's default; `gelu` is the tanh form)",
    flops=8,
)
defop(
    "gelu_erf_grad",
    inputs=("dy", "x"),
    infer=_gelu_erf_grad_infer,
    rows=lambda m, a: rows.elementwise(m, linear=(True, False)),  # linear in dy
    kernel=_gelu_erf_grad_kernel,
    grad=NoGrad("backward op of gelu_erf"),
    doc="dy (Phi(x) + x phi(x)): dy times the derivative of exact GELU",
    flops=12,
)


# ---- binary cross-entropy with logits ------------------------------------------------------------

_REDUCTIONS = ("mean", "sum", "none")


def _bce_infer(metas: Metas, attrs: Attrs) -> Metas:
    logits, targets = metas
    check_kind("binary_cross_entropy_with_logits", "logits", logits, "floating")
    same_dtype("binary_cross_entropy_with_logits", ("logits", "targets"), logits, targets)
    if logits.shape != targets.shape:
        raise ShapeError(
            f"op 'binary_cross_entropy_with_logits' needs logits and targets of one shape, got {logits} "
            f"and {targets}; reshape the targets (e.g. labels [N] for logits [N])"
        )
    if attrs["reduction"] not in _REDUCTIONS:
        raise ShapeError(
            f"op 'binary_cross_entropy_with_logits' got reduction={attrs['reduction']!r}; use one of "
            f"{list(_REDUCTIONS)}"
        )
    return (logits if attrs["reduction"] == "none" else TensorMeta((), logits.dtype),)


def _bce_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    if attrs["reduction"] == "none":
        return rows.elementwise(metas)  # affine, not linear, in the targets: no P
    # each rank reduces the elements it holds; the mean divides by the logical count: partial sums
    return [*(Signature((Split(i), Split(i)), (P,)) for i in range(metas[0].ndim)), rows.all_broadcast(2, 1)]


def _bce_kernel(ctx: KernelContext, x: Any, t: Any) -> Any:
    """max(x, 0) - x t + log(1 + exp(-|x|)): log(sigmoid) without exp overflowing or log(0); one pass on
    numpy (elementwise_jit's loops), ~8 numpy passes otherwise."""
    xp, reduction = ctx.xp, ctx.attrs["reduction"]
    if reduction == "none":
        if (y := jit_elementwise(ctx, "bce_logits_all", x, t)) is not None:
            return y
    elif (jit := jit_loops("elementwise_jit", xp, x, t)) is not None:  # one shape: _bce_infer's and the rows'
        return _reduced(ctx, jit.bce_logits_sum(x.reshape(-1), t.reshape(-1)), x.dtype)
    loss = xp.abs(x)
    loss = xp.log1p(xp.exp(xp.negative(loss, out=loss), out=loss), out=loss)
    one = x.dtype.type(1)  # max(x, 0) - x t as one term, x (1 - t) or -x t: no cancellation (see the loop)
    loss = xp.add(loss, xp.where(x > 0, x * xp.subtract(one, t), -(x * t)), out=loss)
    return loss if reduction == "none" else _reduced(ctx, xp.sum(loss), x.dtype)


def _reduced(ctx: KernelContext, total: Any, dtype: Any) -> Any:
    if ctx.attrs["reduction"] == "mean":  # the logical count: a shard's share of the mean, for the P rows
        total = total / max(ctx.in_metas[0].numel, 1)
    return ctx.xp.asarray(total, dtype=dtype)


def _bce_grad(g: GradContext) -> list[Any]:
    """d/dlogits = (sigmoid(x) - t) dy, d/dtargets = -x dy, each divided by the count for the mean."""
    x, t = g.inputs
    dy = g.dy
    if g.attrs["reduction"] == "mean":
        dy = g.call("mul_scalar", dy, value=1.0 / max(g.in_metas[0].numel, 1))
    dlogits = g.call("mul", g.call("sub", g.call("sigmoid", x), t), dy)
    return [dlogits, g.call("mul", g.call("neg", x), dy)]


defop(
    "binary_cross_entropy_with_logits",
    inputs=("logits", "targets"),
    outputs=("loss",),
    infer=_bce_infer,
    rows=_bce_rows,
    kernel=_bce_kernel,
    grad=_bce_grad,
    attrs={"reduction": "mean"},
    doc="-(t log sigmoid(x) + (1 - t) log(1 - sigmoid(x))), stable form; reduction mean, sum or none",
    flops=5,
)
