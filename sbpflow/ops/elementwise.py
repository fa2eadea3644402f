"""Elementwise ops: numpy-broadcasting arithmetic, scalar arithmetic, activations, casts.

Rows: an elementwise op can work on any slice, so every axis may be split (aligned across inputs under
broadcasting); ``P`` passes only through inputs the op is linear in.
"""

from __future__ import annotations

from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import REQUIRED, Attrs, GradContext, KernelContext, Metas, NoGrad, defop
from sbpflow.tensor_meta import TensorMeta


def broadcast_shapes(op: str, metas: Metas) -> tuple[int, ...]:
    ndim = max(m.ndim for m in metas)
    out = []
    for axis in range(ndim):
        sizes = {m.shape[axis - (ndim - m.ndim)] for m in metas if axis - (ndim - m.ndim) >= 0}
        if len(sizes - {1}) > 1:
            shapes = " and ".join(str(list(m.shape)) for m in metas)
            raise ShapeError(f"op {op!r} cannot broadcast shapes {shapes}; sizes {sorted(sizes)} clash at axis {axis}")
        out.append(max(sizes))
    return tuple(out)


def _binary_infer(op: str) -> Any:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        a, b = metas
        if a.dtype != b.dtype:
            raise ShapeError(
                f"op {op!r} got dtypes {a.dtype.value} and {b.dtype.value}; cast one with sf.cast(x, dtype)"
            )
        return (TensorMeta(broadcast_shapes(op, metas), a.dtype),)

    return infer


def _unbroadcast(g: GradContext, grad: Any, i: int) -> Any:
    """Sum a gradient over the axes along which input ``i`` was broadcast."""
    if g.in_metas[i].shape == g.out_metas[0].shape:
        return grad
    return g.call("sum_to", grad, shape=g.in_metas[i].shape)


def _add_grad(g: GradContext) -> list[Any]:
    return [_unbroadcast(g, g.dy, 0), _unbroadcast(g, g.dy, 1)]


defop(
    "add",
    inputs=("a", "b"),
    infer=_binary_infer("add"),
    rows=lambda m, a: rows.broadcasting(m, max(x.ndim for x in m), sum_partial=True),
    kernel=lambda ctx, a, b: a + b,
    grad=_add_grad,
    doc="a + b with numpy broadcasting",
)


def _mul_grad(g: GradContext) -> list[Any]:
    a, b = g.inputs
    return [_unbroadcast(g, g.call("mul", g.dy, b), 0), _unbroadcast(g, g.call("mul", g.dy, a), 1)]


defop(
    "mul",
    inputs=("a", "b"),
    infer=_binary_infer("mul"),
    rows=lambda m, a: rows.broadcasting(m, max(x.ndim for x in m), linear=(True, True)),
    kernel=lambda ctx, a, b: a * b,
    grad=_mul_grad,
    doc="a * b with numpy broadcasting; linear in each input, so P x B -> P",
)


def _same(metas: Metas, attrs: Attrs) -> Metas:
    return (metas[0],)


defop(
    "relu",
    inputs=("x",),
    infer=_same,
    rows=lambda m, a: rows.elementwise(m),
    kernel=lambda ctx, x: ctx.xp.maximum(x, x.dtype.type(0)),
    grad=lambda g: [g.call("relu_grad", g.dy, g.outputs[0])],
)


def _relu_grad_kernel(ctx: KernelContext, dy: Any, y: Any) -> Any:
    return dy * (y > 0).astype(dy.dtype)


defop(
    "relu_grad",
    inputs=("dy", "y"),
    infer=_same,
    rows=lambda m, a: rows.elementwise(m, linear=(True, False)),
    kernel=_relu_grad_kernel,
    grad=NoGrad("backward op of relu"),
)
