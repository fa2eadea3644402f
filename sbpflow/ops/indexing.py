"""Index ops: gather along an axis (ONNX Gather, ``np.take``; PyTorch's index_select for a 1-d index),
one_hot, top-k along the last axis, and their backward ops.

Rows: gather moves elements, so it is linear in the table (``P -> P``). A table split along the
gathered axis gives each rank the rows it owns and zeros for the rest: a partial sum, like the
embedding's vocabulary split. one_hot may split its depth axis (each rank writes its own columns) and
top-k needs whole rows (the k largest of a row are not found from a part of it).
"""

from __future__ import annotations

import math
from typing import Any

from sbpflow.dtype import DType, as_dtype
from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import REQUIRED, Attrs, GradContext, KernelContext, Metas, NoGrad, Signature, defop
from sbpflow.ops.kernels.rowwise import jit_loops, jit_rows
from sbpflow.ops.shape import in_range, scatter_add
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta

_INDEX_DTYPES = (DType.int32, DType.int64)


def _check_indices(op: str, indices: TensorMeta) -> None:
    if indices.dtype not in _INDEX_DTYPES:
        raise ShapeError(
            f"op {op!r} needs int32/int64 indices, got {indices}; cast with sf.cast(i, sf.int64)"
        )


def _gather_axis(op: str, ndim: int, attrs: Attrs) -> int:
    axis = attrs["axis"]
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ShapeError(f"op {op!r} got axis={axis!r} for a {ndim}-d table; use an axis in 0..{ndim - 1}")
    return axis % ndim


# ---- gather: out = take(x, indices, axis), and its scatter-add gradient ----------------------------


def _gather_infer(metas: Metas, attrs: Attrs) -> Metas:
    x, indices = metas
    _check_indices("gather", indices)
    a = _gather_axis("gather", x.ndim, attrs)
    return (TensorMeta((*x.shape[:a], *indices.shape, *x.shape[a + 1 :]), x.dtype),)


def _gather_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    x, indices = metas
    a, m = _gather_axis("gather", x.ndim, attrs), indices.ndim
    out: list[Signature] = [
        *(Signature((Split(k), B), (Split(k if k < a else k + m - 1),)) for k in range(x.ndim) if k != a),
        *(Signature((B, Split(j)), (Split(a + j),)) for j in range(m)),  # split the indices
        Signature((Split(a), B), (P,)),  # table split by rows: each rank's rows, zeros for the others
        Signature((P, B), (P,)),  # linear in the table
        rows.all_broadcast(2, 1),
    ]
    return out


def _gather_kernel(ctx: KernelContext, x: Any, indices: Any) -> Any:
    xp = ctx.xp
    a = _gather_axis("gather", x.ndim, ctx.attrs)
    if (jit := jit_loops("pool_jit", xp, x)) is not None:  # one pass over the rows (pool_jit.py)
        pre, post = x.shape[:a], x.shape[a + 1 :]
        out = xp.empty((*pre, *indices.shape, *post), dtype=x.dtype)
        table = x.reshape(math.prod(pre), x.shape[a], math.prod(post))  # sizes, not -1: no index is fine
        ids = xp.ascontiguousarray(indices).reshape(-1)
        jit.take_rows(
            table, ids, ctx.in_index[0][a].start, out.reshape(table.shape[0], ids.size, table.shape[2])
        )
        return out
    local, hit = in_range(xp, indices, ctx.in_index[0][a])
    if bool(hit.all()):  # every index on this rank (always, unsplit): nothing to zero
        return xp.take(x, local, axis=a)
    found = xp.take(x, xp.where(hit, local, 0), axis=a)
    mask = hit.reshape((1,) * a + hit.shape + (1,) * (x.ndim - a - 1))
    return xp.where(mask, found, x.dtype.type(0))


defop(
    "gather",
    inputs=("x", "indices"),
    infer=_gather_infer,
    rows=_gather_rows,
    kernel=_gather_kernel,
    grad=lambda g: [
        g.call(
            "gather_grad", g.dy, g.inputs[1], axis=g.attrs["axis"], size=g.in_metas[0].shape[g.attrs["axis"]]
        ),
        None,
    ],
    attrs={"axis": 0},
    doc="x's slices at indices (in [0, n)) along `axis`: [*x[:axis], *indices.shape, *x[axis+1:]]",
    flops=0,
)


def _gather_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, indices = metas
    _check_indices("gather_grad", indices)
    m, size = indices.ndim, attrs["size"]
    ndim = dy.ndim - m + 1
    a = _gather_axis("gather_grad", ndim, attrs) if ndim >= 1 else 0
    if ndim < 1 or dy.shape[a : a + m] != indices.shape or not isinstance(size, int) or size < 1:
        raise ShapeError(
            f"op 'gather_grad' needs dy [*x[:axis], *indices.shape, *x[axis+1:]] and size >= 1, got dy {dy}, "
            f"indices {indices}, axis={attrs['axis']!r}, size={size!r}"
        )
    return (TensorMeta((*dy.shape[:a], size, *dy.shape[a + m :]), dy.dtype),)


def _gather_grad_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    dy, indices = metas
    m = indices.ndim
    ndim = dy.ndim - m + 1
    a = _gather_axis("gather_grad", ndim, attrs)
    return [
        *(Signature((Split(k if k < a else k + m - 1), B), (Split(k),)) for k in range(ndim) if k != a),
        *(Signature((Split(a + j), Split(j)), (P,)) for j in range(m)),  # each rank adds its indices' slices
        Signature((B, B), (Split(a),)),  # table split by rows: each rank keeps the rows it owns
        Signature((P, B), (P,)),
        rows.all_broadcast(2, 1),
    ]


def _gather_grad_kernel(ctx: KernelContext, dy: Any, indices: Any) -> Any:
    xp = ctx.xp
    m = indices.ndim
    a = _gather_axis("gather_grad", dy.ndim - m + 1, ctx.attrs)
    size, here = ctx.out_shape(0)[a], ctx.out_index[0][a]
    # as rows, the gathered axis first: dx [size, pre * post] and dy [M, pre * post]
    pre, post = dy.shape[:a], dy.shape[a + m :]
    row = math.prod(pre) * math.prod(post)  # not -1: no index is fine
    values = xp.moveaxis(dy.reshape((*pre, indices.size, *post)), a, 0).reshape(indices.size, row)
    values = xp.ascontiguousarray(values)  # a copy only of a moved axis: add_rows_at takes rows
    out = xp.zeros((size, *pre, *post), dtype=dy.dtype)
    rows_out = out.reshape(size, row)  # a view: adds into out
    if (jit := jit_rows(xp, values, rows_out)) is not None:  # one pass, in row order (rows_jit.py)
        jit.add_rows_at(rows_out, xp.ascontiguousarray(indices).reshape(-1), here.start, values)
    else:  # under dy B -> S(axis) each rank adds only the rows it owns
        local, hit = in_range(xp, indices.reshape(-1), here)
        scatter_add(xp, rows_out, local[hit], values[hit])
    return xp.ascontiguousarray(xp.moveaxis(out, 0, a))


defop(
    "gather_grad",
    inputs=("dy", "indices"),
    outputs=("dx",),
    infer=_gather_grad_infer,
    rows=_gather_grad_rows,
    kernel=_gather_grad_kernel,
    grad=NoGrad("backward op of gather"),
    attrs={"axis": 0, "size": REQUIRED},
    doc="dx: dy's slices added at their indices along `axis` of a table of `size` there",
    flops=0,
)


# ---- one_hot -------------------------------------------------------------------------------------


def _one_hot_infer(metas: Metas, attrs: Attrs) -> Metas:
    (indices,) = metas
    _check_indices("one_hot", indices)
    depth = attrs["depth"]
    if not isinstance(depth, int) or depth < 1:
        raise ShapeError(f"op 'one_hot' needs depth >= 1, got depth={depth!r}")
    return (TensorMeta((*indices.shape, depth), as_dtype(attrs["dtype"])),)


def _one_hot_kernel(ctx: KernelContext, indices: Any) -> Any:
    xp = ctx.xp
    cols = ctx.out_index[0][-1]  # the depth split: this rank's columns
    here = xp.arange(cols.start, cols.stop, dtype=indices.dtype)
    return xp.equal(indices[..., None], here).astype(ctx.out_dtype())


defop(
    "one_hot",
    inputs=("indices",),
    infer=_one_hot_infer,
    rows=lambda m, a: [
        *(Signature((Split(j),), (Split(j),)) for j in range(m[0].ndim)),
        Signature((B,), (Split(m[0].ndim),)),  # depth split: each rank writes its own columns
        rows.all_broadcast(1, 1),
    ],
    kernel=_one_hot_kernel,
    grad=NoGrad("integer input: the indices take no gradient"),
    attrs={"depth": REQUIRED, "dtype": DType.float32},
    doc="1 at [..., indices[...]] and 0 elsewhere, [*indices.shape, depth]; an index outside [0, depth) "
    "gives a row of zeros",
    flops=0,
)


# ---- topk along the last axis, and the scatter of its values' gradient -----------------------------


def _topk_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    k = attrs["k"]
    if x.ndim == 0 or x.dtype is DType.bool or not isinstance(k, int) or not 1 <= k <= x.shape[-1]:
        raise ShapeError(
            f"op 'topk' needs a numeric x of >= 1 axis and 1 <= k <= its last size; got x {x}, k={k!r}"
        )
    shape = (*x.shape[:-1], k)
    return (TensorMeta(shape, x.dtype), TensorMeta(shape, DType.int64))


def _topk_kernel(ctx: KernelContext, x: Any) -> tuple[Any, Any]:
    # descending; ties go to the lower index (a stable sort of -x), the same on any split of the rows
    xp, k = ctx.xp, int(ctx.attrs["k"])
    if (jit := jit_loops("pool_jit", xp, x)) is not None:  # one pass a row (pool_jit.py)
        values, indices = xp.empty((*x.shape[:-1], k), x.dtype), xp.empty((*x.shape[:-1], k), xp.int64)
        rows = x.shape[-1]
        jit.topk_rows(x.reshape(-1, rows), k, values.reshape(-1, k), indices.reshape(-1, k))
        return values, indices
    kind = {"kind": "stable"} if xp.__name__ == "numpy" else {}
    order = xp.argsort(xp.negative(x), axis=-1, **kind)[..., :k]
    return xp.take_along_axis(x, order, axis=-1), order.astype(xp.int64, copy=False)


def _topk_grad(g: GradContext) -> list[Any]:
    dvalues = g.grads[0]  # the indices output is an integer result: no gradient flows through it
    if dvalues is None:
        return [None]
    return [g.call("topk_grad", dvalues, g.outputs[1], size=g.in_metas[0].shape[-1])]


defop(
    "topk",
    inputs=("x",),
    outputs=("values", "indices"),
    infer=_topk_infer,
    rows=lambda m, a: [
        *(Signature((Split(i),), (Split(i), Split(i))) for i in range(m[0].ndim - 1)),
        rows.all_broadcast(1, 2),
    ],
    kernel=_topk_kernel,
    grad=_topk_grad,
    attrs={"k": REQUIRED},
    doc="the k largest of each last-axis row, descending, and their int64 positions (ties: lower first)",
    flops=0,
)


def _topk_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, indices = metas
    size = attrs["size"]
    if (
        dy.shape != indices.shape
        or dy.ndim == 0
        or indices.dtype is not DType.int64
        or not isinstance(size, int)
    ):
        raise ShapeError(
            f"op 'topk_grad' needs dy and int64 indices of one shape and a size, got {dy}, {indices}"
        )
    if not dy.shape[-1] <= size:
        raise ShapeError(f"op 'topk_grad': size={size} is below k={dy.shape[-1]}")
    return (TensorMeta((*dy.shape[:-1], size), dy.dtype),)


def _topk_grad_kernel(ctx: KernelContext, dy: Any, indices: Any) -> Any:
    xp = ctx.xp
    k = dy.shape[-1]
    fits = indices.shape == dy.shape and ctx.out_shape(0)[:-1] == dy.shape[:-1]  # the loop does not check
    if fits and (jit := jit_loops("pool_jit", xp, dy)) is not None:
        out = xp.empty(ctx.out_shape(0), dtype=dy.dtype)
        rows_ix = xp.ascontiguousarray(indices).reshape(-1, k)
        if jit.topk_grad_rows(dy.reshape(-1, k), rows_ix, out.reshape(-1, out.shape[-1])):
            return out
    out = xp.zeros(ctx.out_shape(0), dtype=dy.dtype)
    flat = out.reshape(-1, out.shape[-1])  # a view: writes into out
    row = xp.arange(flat.shape[0])[:, None]
    flat[row, indices.reshape(-1, k)] = dy.reshape(-1, k)  # a row's positions are distinct: no sums
    return out


defop(
    "topk_grad",
    inputs=("dy", "indices"),
    outputs=("dx",),
    infer=_topk_grad_infer,
    rows=lambda m, a: [
        *(Signature((Split(i), Split(i)), (Split(i),)) for i in range(m[0].ndim - 1)),
        Signature((P, B), (P,)),  # linear in dy
        rows.all_broadcast(2, 1),
    ],
    kernel=_topk_grad_kernel,
    grad=NoGrad("backward op of topk"),
    attrs={"size": REQUIRED},
    doc="dx [..., size]: zeros with dy written at the top-k positions of each row",
    flops=0,
)
