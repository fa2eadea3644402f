"""Elementwise ops: numpy-broadcasting arithmetic, scalar arithmetic, unary math, and casts (masks, dropout and
``full`` live in masking.py, GELU and sigmoid in activation.py); ``jit_elementwise``, the choice of
elementwise_jit's numba loops.

Rows: an elementwise op can work on any slice, so every axis may be split (aligned across inputs under
broadcasting); ``P`` passes only through inputs the op is linear in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any, Literal

from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import (
    REQUIRED,
    Attrs,
    GradContext,
    InferFn,
    KernelContext,
    Metas,
    NoGrad,
    Signature,
    defop,
)
from sbpflow.ops.kernels.rowwise import loop_into
from sbpflow.tensor_meta import TensorMeta

Grads = list[Any]
Kind = Literal["any", "numeric", "floating"]  # which dtypes an input accepts


# ---- inference helpers --------------------------------------------------------------------------------


def broadcast_shapes(op: str, metas: Metas) -> tuple[int, ...]:
    ndim = max(m.ndim for m in metas)
    out = []
    for axis in range(ndim):
        sizes = {m.shape[axis - (ndim - m.ndim)] for m in metas if axis - (ndim - m.ndim) >= 0}
        if len(sizes - {1}) > 1:
            shapes = " and ".join(str(list(m.shape)) for m in metas)
            raise ShapeError(
                f"op {op!r} cannot broadcast shapes {shapes}: sizes {sorted(sizes)} clash at output axis "
                f"{axis}; make them equal or 1 (reshape or sum_to one of the inputs)"
            )
        out.append((sizes - {1} or {1}).pop())  # a 0 broadcasts against 1 to 0
    return tuple(out)


def check_kind(op: str, name: str, meta: TensorMeta, kind: Kind) -> None:
    """Refuse bool (and, for floating ops, integer) tensors, where the math has no meaning."""
    if kind == "any":
        return
    if meta.dtype is DType.bool or (kind == "floating" and not meta.dtype.is_floating):
        raise ShapeError(
            f"op {op!r} needs a {kind} tensor for {name!r}, got {meta}; "
            f"cast it first with sf.cast({name}, sf.float32)"
        )


def check_scalar(op: str, attr: str, value: Any, dtype: DType) -> None:
    """An integer tensor keeps its dtype, so a scalar applied to it must be integral."""
    if not dtype.is_floating and float(value) != int(value):
        raise ShapeError(
            f"op {op!r} got {attr}={value}, but the tensor is {dtype.value} and keeps its dtype; "
            f"use an integral {attr} or cast the tensor to a float dtype first"
        )


def _unary_infer(op: str, kind: Kind = "numeric", scalar: str | None = None) -> InferFn:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        (x,) = metas
        check_kind(op, "x", x, kind)
        if scalar is not None:
            check_scalar(op, scalar, attrs[scalar], x.dtype)
        return (x,)

    return infer


def same_dtype(op: str, names: tuple[str, str], a: TensorMeta, b: TensorMeta) -> None:
    if a.dtype != b.dtype:
        raise ShapeError(
            f"op {op!r} needs one dtype for {names[0]!r} and {names[1]!r}, got {names[0]}: {a} and "
            f"{names[1]}: {b}; cast one, e.g. sf.cast({names[1]}, {a.dtype!r})"
        )


def check_bool(op: str, name: str, meta: TensorMeta) -> None:
    if meta.dtype is not DType.bool:
        raise ShapeError(
            f"op {op!r} needs a bool tensor for {name!r}, got {meta}; make one with ne_scalar/eq_scalar"
        )


def scalar_of(dtype: Any, value: float) -> Any:
    """``value`` as a scalar of the tensor's dtype, so that the result keeps that dtype."""
    return dtype.type(value)


@cache
def zero_of(dtype: Any) -> Any:
    """0 of ``dtype``, made once: building the scalar was a fifth of a small relu's 1 us."""
    return dtype.type(0)


def fill_value(xp: Any, dtype: Any, value: float) -> Any:
    """A 0-d fill array of ``dtype`` (cupy's where wants arrays); a finite value past the dtype's range
    (-1e30 in float16) is clamped to its largest finite value, not overflowed to inf, so that a masked
    softmax row stays finite."""
    if dtype.kind == "f" and math.isfinite(value):
        info = xp.finfo(dtype)
        value = min(max(value, float(info.min)), float(info.max))
    return xp.asarray(value, dtype=dtype)


def unbroadcast(g: GradContext, grad: Any, i: int) -> Any:
    """Sum a gradient over the axes along which input ``i`` was broadcast."""
    if g.in_metas[i].shape == g.out_metas[0].shape:
        return grad
    return g.call("sum_to", grad, shape=g.in_metas[i].shape)


def same_shape_rows(linear: tuple[bool, ...] = ()) -> Callable[[Metas, Attrs], list[Signature]]:
    return lambda m, a: rows.elementwise(m, linear=linear)


def _broadcast_rows(linear: tuple[bool, ...], sum_partial: bool) -> Callable[[Metas, Attrs], list[Signature]]:
    return lambda m, a: rows.broadcasting(m, max(x.ndim for x in m), linear=linear, sum_partial=sum_partial)


# ---- binary arithmetic with numpy broadcasting -----------------------------------------------------------


def _binary_infer(op: str, kind: Kind) -> InferFn:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        a, b = metas
        same_dtype(op, ("a", "b"), a, b)
        check_kind(op, "a", a, kind)
        return (TensorMeta(broadcast_shapes(op, metas), a.dtype),)

    return infer


def _add_grad(g: GradContext) -> Grads:
    return [unbroadcast(g, g.dy, 0), unbroadcast(g, g.dy, 1)]


def _sub_grad(g: GradContext) -> Grads:
    return [unbroadcast(g, g.dy, 0), unbroadcast(g, g.call("neg", g.dy), 1)]


def _mul_grad(g: GradContext) -> Grads:
    a, b = g.inputs
    return [unbroadcast(g, g.call("mul", g.dy, b), 0), unbroadcast(g, g.call("mul", g.dy, a), 1)]


def _div_grad(g: GradContext) -> Grads:
    b, y = g.inputs[1], g.outputs[0]
    db = g.call("neg", g.call("div", g.call("mul", g.dy, y), b))  # d(a/b)/db = -(a/b)/b
    return [unbroadcast(g, g.call("div", g.dy, b), 0), unbroadcast(g, db, 1)]


def _binary_kernel(fn: Callable[[Any, Any], Any], ufunc: str) -> Callable[..., Any]:
    """``fn(a, b)``, or the ufunc written into the runtime's dead previous output (``ctx.out_array``)."""

    def kernel(ctx: KernelContext, a: Any, b: Any) -> Any:
        # a bias ([..., n] + [n], or a position table): half numpy's broadcast time, once the array
        # outweighs a numba call's ~1.5 us
        if ufunc == "add" and 0 < getattr(b, "ndim", 0) < a.ndim and a.size >= 4096:
            if (y := jit_elementwise(ctx, "add_rows", a, b)) is not None:
                return y
        out = ctx.out_array(0)
        return fn(a, b) if out is None else getattr(ctx.xp, ufunc)(a, b, out=out)

    return kernel


_UFUNC = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide"}

# name: (kernel, P through (a, b) one at a time, P in both at once, input kind, grad, doc)
_BINARY: dict[str, tuple[Callable[[Any, Any], Any], tuple[bool, bool], bool, Kind, Any, str]] = {
    "add": (lambda a, b: a + b, (False, False), True, "numeric", _add_grad, "a + b"),
    "sub": (lambda a, b: a - b, (False, False), True, "numeric", _sub_grad, "a - b"),
    "mul": (lambda a, b: a * b, (True, True), False, "numeric", _mul_grad, "a * b; linear in each input"),
    "div": (lambda a, b: a / b, (True, False), False, "floating", _div_grad, "a / b; linear in a only"),
}

for _name, (_fn, _linear, _sum_partial, _kind, _grad, _doc) in _BINARY.items():
    defop(
        _name,
        inputs=("a", "b"),
        infer=_binary_infer(_name, _kind),
        rows=_broadcast_rows(_linear, _sum_partial),
        kernel=_binary_kernel(_fn, _UFUNC[_name]),
        grad=_grad,
        doc=f"{_doc}, with numpy broadcasting",
        flops=1,
    )


# ---- tensor-scalar arithmetic -----------------------------------------------------------------------------
# add_scalar and rsub_scalar are affine, not linear: P + c summed over ranks adds c once per rank.

# name: (kernel(x, v), linear, input kind, grad, doc)
_SCALAR: dict[str, tuple[Callable[[Any, Any], Any], bool, Kind, Any, str]] = {
    "add_scalar": (lambda x, v: x + v, False, "numeric", lambda g: [g.dy], "x + value"),
    "mul_scalar": (
        lambda x, v: x * v,
        True,
        "numeric",
        lambda g: [g.call("mul_scalar", g.dy, value=g.attrs["value"])],
        "x * value",
    ),
    "rsub_scalar": (lambda x, v: v - x, False, "numeric", lambda g: [g.call("neg", g.dy)], "value - x"),
    "rdiv_scalar": (  # d(v/x)/dx = -(v/x)/x
        lambda x, v: v / x,
        False,
        "floating",
        lambda g: [g.call("neg", g.call("div", g.call("mul", g.dy, g.outputs[0]), g.inputs[0]))],
        "value / x",
    ),
}

for _name, (_sfn, _lin, _kind, _grad, _doc) in _SCALAR.items():
    defop(
        _name,
        inputs=("x",),
        attrs={"value": REQUIRED},
        infer=_unary_infer(_name, _kind, scalar="value"),
        rows=same_shape_rows((_lin,)),
        kernel=lambda ctx, x, fn=_sfn: fn(x, scalar_of(x.dtype, ctx.attrs["value"])),
        grad=_grad,
        doc=f"{_doc}, in x's dtype",
        flops=1,
    )


def owned(xp: Any, x: Any) -> Any:
    """A fresh array shaped like ``x`` for a kernel to compute into with ``out=`` (a 0-d one too, where an
    operation on a 0-d array would give a scalar that cannot be written into)."""
    return xp.empty_like(x)


def cube(xp: Any, x: Any, out: Any = None) -> Any:
    y = xp.multiply(x, x, out=owned(xp, x) if out is None else out)
    return xp.multiply(y, x, out=y)


# Small exponents as products, a square root or a reciprocal: numpy's generic float32 power is ~40x
# slower than a product. Each is the correctly rounded result of one operation (x**3: two), so it may
# differ from libm's pow in the last bit, as pow is not always correctly rounded.
_POWERS: dict[float, Callable[[Any, Any], Any]] = {
    0.0: lambda xp, x: xp.ones_like(x),  # x**0 == 1, nan and inf included
    1.0: lambda xp, x: x.copy(),
    2.0: lambda xp, x: xp.multiply(x, x, out=owned(xp, x)),
    3.0: cube,
    0.5: lambda xp, x: xp.sqrt(x, out=owned(xp, x)),
    -1.0: lambda xp, x: xp.divide(x.dtype.type(1), x, out=owned(xp, x)),
}


def power(xp: Any, x: Any, exponent: float) -> Any:
    """``x ** exponent`` in x's dtype, without numpy's generic pow for the exponents of :data:`_POWERS`."""
    fast = _POWERS.get(exponent)
    return fast(xp, x) if fast is not None else xp.power(x, scalar_of(x.dtype, exponent))


def _pow_grad(g: GradContext) -> Grads:
    e = float(g.attrs["exponent"])  # type: ignore[arg-type]
    if e == 0.0:  # x**0 is constant; x**-1 * 0 would give nan at x == 0
        return [g.call("mul_scalar", g.dy, value=0.0)]
    slope = g.call("mul_scalar", g.call("pow_scalar", g.inputs[0], exponent=e - 1.0), value=e)
    return [g.call("mul", g.dy, slope)]


defop(
    "pow_scalar",
    inputs=("x",),
    attrs={"exponent": REQUIRED},
    infer=_unary_infer("pow_scalar", "floating"),
    rows=same_shape_rows(),
    kernel=lambda ctx, x: power(ctx.xp, x, float(ctx.attrs["exponent"])),
    grad=_pow_grad,
    doc="x ** exponent (nan for negative x and a non-integral exponent, as in numpy)",
    flops=1,
)


# ---- activations and unary math ---------------------------------------------------------------------------


def jit_elementwise(ctx: KernelContext, loop: str, *inputs: Any) -> Any:
    """Output 0 computed by elementwise_jit's one-pass ``loop``, into the runtime's dead previous output
    where it fits (rowwise.loop_into); None where the loop does not take the inputs and the numpy kernel
    runs."""
    return loop_into(ctx.xp, loop, inputs, ctx.out_array(0), lent=True)


def _relu_kernel(ctx: KernelContext, x: Any) -> Any:
    y = jit_elementwise(ctx, "relu_all", x)
    return ctx.xp.maximum(x, zero_of(x.dtype), out=ctx.out_array(0)) if y is None else y


def _relu_grad_kernel(ctx: KernelContext, dy: Any, y: Any) -> Any:
    # one pass, no boolean temporary, where that pays for the loop's calling: [32, 16, 16, 16] float32 31 us
    # against numpy's 59, [32, 64, 4, 4] 10 against 16; [32, 32] 5.9 against 3.0
    if getattr(dy, "size", 0) >= 4096 and (g := jit_elementwise(ctx, "relu_grad_all", dy, y)) is not None:
        return g
    out = ctx.out_array(0)  # the memory plan's dead buffer, or a new array
    return ctx.xp.multiply(dy, y > 0, out=owned(ctx.xp, dy) if out is None else out)  # bool to dy's dtype


def _y(g: GradContext) -> Any:
    return g.outputs[0]


def _jit_or_ufunc(loop: str, ufunc: str) -> Callable[[KernelContext, Any], Any]:
    """A unary op's kernel: elementwise_jit's one-pass ``loop`` (jit_math's vectorised exp or log) where
    it takes x, else the array module's ``ufunc`` (numpy's float32 exp and log run scalar on AVX2, ~3x
    PyTorch's time; the loop is under PyTorch's)."""

    def kernel(ctx: KernelContext, x: Any) -> Any:
        y = jit_elementwise(ctx, loop, x)
        return getattr(ctx.xp, ufunc)(x) if y is None else y

    return kernel


# name: (kernel(ctx, x), input kind, linear, grad, doc, flops per element, fp32 under mixed precision)
_UNARY: dict[str, tuple[Callable[[KernelContext, Any], Any], Kind, bool, Any, str, int, bool]] = {
    "relu": (
        _relu_kernel,
        "numeric",
        False,
        lambda g: [g.call("relu_grad", g.dy, _y(g))],
        "max(x, 0)",
        1,
        False,
    ),
    "tanh": (  # d tanh = 1 - y^2
        lambda ctx, x: ctx.xp.tanh(x),
        "floating",
        False,
        lambda g: [g.call("mul", g.dy, g.call("rsub_scalar", g.call("mul", _y(g), _y(g)), value=1.0))],
        "tanh(x)",
        4,  # transcendental: fvcore counts a handful
        False,
    ),
    "exp": (
        _jit_or_ufunc("exp_all", "exp"),
        "floating",
        False,
        lambda g: [g.call("mul", g.dy, _y(g))],
        "e ** x",
        1,
        True,  # overflows fp16 past x = 11
    ),
    "log": (
        _jit_or_ufunc("log_all", "log"),
        "floating",
        False,
        lambda g: [g.call("div", g.dy, g.inputs[0])],
        "ln x",
        1,
        True,  # fp16 loses the small arguments a loss takes the log of
    ),
    "sqrt": (  # d sqrt = 0.5 / y
        lambda ctx, x: ctx.xp.sqrt(x),
        "floating",
        False,
        lambda g: [g.call("div", g.call("mul_scalar", g.dy, value=0.5), _y(g))],
        "sqrt(x)",
        1,
        False,
    ),
    "neg": (lambda ctx, x: -x, "numeric", True, lambda g: [g.call("neg", g.dy)], "-x", 1, False),
}

for _name, (_ufn, _kind, _lin, _grad, _doc, _flops, _fp32) in _UNARY.items():
    defop(
        _name,
        inputs=("x",),
        infer=_unary_infer(_name, _kind),
        rows=same_shape_rows((_lin,)),
        kernel=_ufn,
        grad=_grad,
        doc=_doc,
        flops=_flops,
        fp32=_fp32,
    )

defop(
    "identity",
    inputs=("x",),
    infer=_unary_infer("identity", "any"),
    rows=same_shape_rows((True,)),
    kernel=lambda ctx, x: x.copy(),
    grad=lambda g: [g.dy],
    doc="x (a copy)",
    flops=0,
    view=True,  # the same bytes as x: the cost model counts none moved
)
defop(  # PyTorch's x.detach(): no gradient flows back through it
    "detach",
    inputs=("x",),
    infer=_unary_infer("detach", "any"),
    rows=same_shape_rows((True,)),
    kernel=lambda ctx, x: x.copy(),
    grad=lambda g: [None],
    doc="x, with no gradient to x",
    flops=0,
    view=True,
)


def grad_infer(op: str, other_name: str) -> InferFn:
    """A backward op's: dy and the forward tensor it reads, of one dtype and shape."""

    def infer(metas: Metas, attrs: Attrs) -> Metas:
        dy, other = metas
        same_dtype(op, ("dy", other_name), dy, other)
        if dy.shape != other.shape:
            raise ShapeError(f"op {op!r} needs dy and its forward tensor of one shape, got {dy} and {other}")
        return (dy,)

    return infer


defop(  # relu's derivative reads its output y, kept for backward anyway
    "relu_grad",
    inputs=("dy", "y"),
    infer=grad_infer("relu_grad", "y"),
    rows=same_shape_rows((True, False)),  # linear in dy
    kernel=_relu_grad_kernel,
    grad=NoGrad("backward op of relu"),
    doc="dy times the derivative of relu",
    flops=1,
)


# ---- casts and comparisons --------------------------------------------------------------------------------

# Casts exact on every share: a partial sum stays a partial sum (up to the rounding of the sum itself,
# which the narrow dtype had anyway; integers convert exactly below 2**53). Narrowing and float -> int
# casts round each share, and rounded shares need not sum to the rounded whole: B or S only.
_WIDENING = {
    (DType.float16, DType.float32),
    (DType.float16, DType.float64),
    (DType.bfloat16, DType.float32),
    (DType.bfloat16, DType.float64),
    (DType.float32, DType.float64),
    (DType.int32, DType.float64),
    (DType.int64, DType.float64),
}


def _cast_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    src, dst = metas[0].dtype, as_dtype(attrs["dtype"])
    keeps_sum = (src == dst and src is not DType.bool) or (src, dst) in _WIDENING
    return rows.elementwise(metas, linear=(keeps_sum,))


def _cast_grad(g: GradContext) -> Grads:
    src, dst = g.in_metas[0].dtype, g.out_metas[0].dtype
    if not (src.is_floating and dst.is_floating):
        return [None]  # an integer or bool on either side has no gradient
    return [g.call("cast", g.dy, dtype=src)]


defop(
    "cast",
    inputs=("x",),
    attrs={"dtype": REQUIRED},
    infer=lambda m, a: (TensorMeta(m[0].shape, as_dtype(a["dtype"])),),
    rows=_cast_rows,
    kernel=lambda ctx, x: x.astype(ctx.out_dtype()),
    grad=_cast_grad,
    doc="x converted to dtype (float -> int truncates toward zero, as numpy does)",
    flops=0,
)

for _name, _cmp in (("ne_scalar", lambda x, v: x != v), ("eq_scalar", lambda x, v: x == v)):
    defop(
        _name,
        inputs=("x",),
        attrs={"value": REQUIRED},
        infer=lambda m, a: (TensorMeta(m[0].shape, DType.bool),),
        rows=same_shape_rows(),
        # a Python scalar, not x's dtype: int labels compared with 0.5 must not round it to 0
        kernel=lambda ctx, x, cmp=_cmp: cmp(x, ctx.attrs["value"]),
        grad=NoGrad("boolean result"),
        doc=f"x {'!=' if _name == 'ne_scalar' else '=='} value, as a bool tensor (e.g. to count labels)",
        flops=1,
    )
