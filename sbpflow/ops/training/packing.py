"""``pack`` and ``unpack``: several tensors as one flat array and back (a gradient bucket).

The compiler's gradient bucketing pass (control_plane/compiler/passes/grad_buckets.py) packs the partial-sum
gradients of a bucket into one 1-d array, all-reduces it once, and unpacks the whole gradients again:
one collective instead of one per gradient, as PyTorch DDP's buckets do.

* ``pack(*xs)`` is the concatenation of the inputs flattened in C order, ``[sum of their sizes]``.
* ``unpack(x, ndims, dims)`` cuts a 1-d ``x`` into consecutive parts of the shapes that ``ndims`` (the rank
  of each part) and ``dims`` (their sizes, one after the other) spell; each part is a view of ``x``.

Both are linear and move every element to a fixed place, so ``P`` passes through (the sum of packed
parts is the packed sum) and so does ``B``. A split does not: a shard of each input is not a shard of
the packed array.
"""

from __future__ import annotations

from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops.base import REQUIRED, Attrs, GradContext, KernelContext, Metas, Signature, defop
from sbpflow.sbp import B, P
from sbpflow.tensor_meta import Shape, TensorMeta


def shapes_attrs(shapes: list[Shape]) -> dict[str, tuple[int, ...]]:
    """The ``ndims`` and ``dims`` attributes of an ``unpack`` into ``shapes``."""
    return {"ndims": tuple(len(s) for s in shapes), "dims": tuple(d for s in shapes for d in s)}


def unpacked_shapes(attrs: Attrs) -> list[Shape]:
    """The part shapes that ``unpack``'s ``ndims`` and ``dims`` spell; a ShapeError if they do not add up."""
    ndims, dims = tuple(attrs["ndims"]), tuple(attrs["dims"])
    if not ndims or any(n < 0 for n in ndims) or sum(ndims) != len(dims) or any(d < 0 for d in dims):
        raise ShapeError(
            f"op 'unpack' got ndims={ndims} and dims={dims}; give one non-negative rank per part and, one "
            "after the other, that many non-negative sizes for each (len(dims) == sum(ndims))"
        )
    out, at = [], 0
    for n in ndims:
        out.append(tuple(dims[at : at + n]))
        at += n
    return out


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _rows(n_in: int, n_out: int) -> list[Signature]:
    return [
        Signature((P,) * n_in, (P,) * n_out),  # linear, every element to a fixed place
        Signature((B,) * n_in, (B,) * n_out),
    ]


def _pack_infer(metas: Metas, attrs: Attrs) -> Metas:
    first = metas[0]
    for i, m in enumerate(metas):
        if m.dtype != first.dtype:
            raise ShapeError(
                f"op 'pack' got xs[0] {first} and xs[{i}] {m}; a bucket holds one dtype: pack each dtype apart"
            )
    return (TensorMeta((sum(_numel(m.shape) for m in metas),), first.dtype),)


def _pack_kernel(ctx: KernelContext, *xs: Any) -> Any:
    return ctx.xp.concatenate([x.reshape(-1) for x in xs])


def _pack_grad(g: GradContext) -> list[Any]:
    parts = g.call_n("unpack", g.dy, **shapes_attrs([m.shape for m in g.in_metas]))
    return list(parts)


def _unpack_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    shapes = unpacked_shapes(attrs)
    total = sum(_numel(s) for s in shapes)
    if x.ndim != 1 or x.shape[0] != total:
        raise ShapeError(
            f"op 'unpack' into parts {shapes} ({total} elements) got x {x}; give the 1-d array that 'pack' made "
            "of exactly those parts"
        )
    return tuple(TensorMeta(s, x.dtype) for s in shapes)


def _unpack_kernel(ctx: KernelContext, x: Any) -> tuple[Any, ...]:
    out, at = [], 0
    for shape in unpacked_shapes(ctx.attrs):
        n = _numel(shape)
        out.append(x[at : at + n].reshape(shape))
        at += n
    return tuple(out)


def _unpack_grad(g: GradContext) -> list[Any]:
    if all(d is None for d in g.grads):
        return [None]
    return [g.call("pack", *g.grads_or_zeros())]


defop(
    "pack",
    inputs=("*xs",),
    infer=_pack_infer,
    rows=lambda m, a: _rows(len(m), 1),
    kernel=_pack_kernel,
    grad=_pack_grad,
    doc="the inputs flattened and joined into one 1-d array (a gradient bucket); linear, so P passes",
    flops=0,
    view=True,
)

defop(
    "unpack",
    inputs=("x",),
    outputs=("*ys",),
    infer=_unpack_infer,
    rows=lambda m, a: _rows(1, len(tuple(a["ndims"]))),
    kernel=_unpack_kernel,
    grad=_unpack_grad,
    attrs={"ndims": REQUIRED, "dims": REQUIRED},
    doc="a 1-d array cut into consecutive parts of the shapes ndims/dims spell, each a view (pack's inverse)",
    flops=0,
    view=True,
)
