"""Contractions: ``matmul`` (batched activations times a 2-d weight) and ``batch_matmul`` (attention).

Rows are generated from each call's einsum string (``"abmk,kn->abmn"``): a kept letter may be split
wherever it appears, a contracted letter split in every operand gives a partial sum, and ``P`` passes
through any one operand because a contraction is linear in each.
"""

from __future__ import annotations

from typing import Any

from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import Attrs, GradContext, KernelContext, Metas, defop
from sbpflow.tensor_meta import Shape, TensorMeta

# letters for leading batch axes; none of them is m, k or n
_BATCH = "abcdefghij"


def _check_dtypes(op: str, a: TensorMeta, b: TensorMeta) -> None:
    if a.dtype != b.dtype:
        raise ShapeError(
            f"op {op!r} got a {a} and b {b} of different dtypes; cast one with sf.cast(x, dtype)"
        )
    if a.dtype.value == "bool":
        raise ShapeError(f"op {op!r} cannot multiply bool tensors; cast them to a number type first")


def _batch(op: str, ndim: int) -> str:
    if ndim - 2 > len(_BATCH):
        raise ShapeError(f"op {op!r} supports at most {len(_BATCH)} batch axes, got {ndim - 2}")
    return _BATCH[: max(ndim - 2, 0)]


def _mk(transpose: bool) -> str:
    return "km" if transpose else "mk"


def _kn(transpose: bool) -> str:
    return "nk" if transpose else "kn"


def _swap_last(x: Any, transpose: bool, xp: Any) -> Any:
    return xp.swapaxes(x, -1, -2) if transpose else x


def _contraction_flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    # a multiply and an add per term of every output: 2 * numel(y) * k
    a = ins[0].shape
    k = a[-2] if attrs.get("transpose_a") and len(a) >= 2 else a[-1]
    return 2 * outs[0].numel * k


# ---- matmul: a [..., m, k] @ b [k, n] -----------------------------------------------------------------


def matmul_spec(a_ndim: int, transpose_a: bool, transpose_b: bool) -> str:
    """``"abmk,kn->abmn"`` for a [A, B, m, k] @ b [k, n]; a 1-d ``a`` is a single row: ``"k,kn->n"``."""
    if a_ndim == 1:
        return f"k,{_kn(transpose_b)}->n"
    batch = _batch("matmul", a_ndim)
    return f"{batch}{_mk(transpose_a)},{_kn(transpose_b)}->{batch}mn"


def _matmul_infer(metas: Metas, attrs: Attrs) -> Metas:
    a, b = metas
    ta, tb = bool(attrs["transpose_a"]), bool(attrs["transpose_b"])
    _check_dtypes("matmul", a, b)
    if b.ndim != 2 or a.ndim < (2 if ta else 1):
        raise ShapeError(
            f"op 'matmul' needs a [..., m, k] ({'at least 2-d with transpose_a' if ta else 'at least 1-d'}) "
            f"and a 2-d b, got a {a} and b {b}; use batch_matmul for a batched b"
        )
    k_a = a.shape[-2] if ta else a.shape[-1]
    k_b, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if k_a != k_b:
        raise ShapeError(
            f"op 'matmul' contracts a {a} (transpose_a={ta}) with b {b} (transpose_b={tb}) "
            f"but their inner sizes differ: {k_a} vs {k_b}; check the transposes"
        )
    m: Shape = () if a.ndim == 1 else (a.shape[-1] if ta else a.shape[-2],)
    return (TensorMeta((*a.shape[:-2], *m, n), a.dtype),)


def _gemm(xp: Any, a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` in their dtype: numpy's bfloat16 (ml_dtypes) matmul accumulates and returns float32,
    rounded here to bfloat16 as a bf16 GEMM with fp32 accumulation does. ``out``: an array of the
    result's shape and dtype to write into (the runtime's dead previous output), or None."""
    if out is not None and out.dtype == a.dtype == b.dtype and a.dtype != "bfloat16":
        return xp.matmul(a, b, out=out)
    y = xp.matmul(a, b)
    return y if y.dtype == a.dtype else y.astype(a.dtype)


def _matmul_kernel(ctx: KernelContext, a: Any, b: Any) -> Any:
    xp = ctx.xp
    b = b.T if ctx.attrs["transpose_b"] else b
    out = ctx.out_array(0)
    if ctx.attrs["transpose_a"]:
        return _gemm(xp, _swap_last(a, True, xp), b, out)
    if a.ndim > 2 and a.flags.c_contiguous:
        # the batch rows as the rows of one GEMM: numpy's matmul otherwise calls BLAS once per batch item
        rows = None if out is None else out.reshape(-1, b.shape[-1])
        y = _gemm(xp, a.reshape(-1, a.shape[-1]), b, rows)
        return out if out is not None and y is rows else y.reshape(*a.shape[:-1], b.shape[-1])
    return _gemm(xp, a, b, out)


def _swap_last_op(g: GradContext, x: Any, ndim: int) -> Any:
    perm = (*range(ndim - 2), ndim - 1, ndim - 2)
    return g.call("transpose", x, perm=perm)


def _flat(g: GradContext, x: Any, ndim: int, last: int) -> Any:
    """[..., last] -> [-1, last]: the batch axes of a become rows of one 2-d contraction."""
    return x if ndim == 2 else g.call("reshape", x, shape=(-1, last))


def _matmul_grad(g: GradContext) -> list[Any]:
    a, b = g.inputs
    ta, tb = bool(g.attrs["transpose_a"]), bool(g.attrs["transpose_b"])
    a_nd, y_nd = g.in_metas[0].ndim, g.out_metas[0].ndim
    # da in [..., m, k] orientation is dy @ op(b)^T; transpose back when a came as [..., k, m]
    da = g.call("matmul", g.dy, b, transpose_b=not tb)
    if ta:
        da = _swap_last_op(g, da, a_nd)
    # db sums a^T dy over every batch row: flatten both to 2-d and contract the rows
    a_mk = _swap_last_op(g, a, a_nd) if ta else a
    k, n = g.in_metas[1].shape[::-1] if tb else g.in_metas[1].shape
    a_rows, dy_rows = _flat(g, a_mk, a_nd, k), _flat(g, g.dy, y_nd, n)
    db = (
        g.call("matmul", dy_rows, a_rows, transpose_a=True)  # [n, k]
        if tb
        else g.call("matmul", a_rows, dy_rows, transpose_a=True)  # [k, n]
    )
    return [da, db]


defop(
    "matmul",
    inputs=("a", "b"),
    infer=_matmul_infer,
    rows=lambda m, a: rows.einsum(matmul_spec(m[0].ndim, bool(a["transpose_a"]), bool(a["transpose_b"]))),
    kernel=_matmul_kernel,
    grad=_matmul_grad,
    attrs={"transpose_a": False, "transpose_b": False},
    doc="a [..., m, k] @ b [k, n] (a weight shared by every batch row); transposes swap the last two axes",
    flops=_contraction_flops,
)


# ---- rows_matmul: a's rows^T @ b's rows, every leading axis contracted -----------------------------------


def rows_matmul_spec(ndim: int) -> str:
    """``"abk,abn->kn"`` for a [A, B, k] and b [A, B, n]: the leading letters are contracted."""
    batch = _batch("rows_matmul", ndim + 1)
    return f"{batch}k,{batch}n->kn"


def _rows_matmul_infer(metas: Metas, attrs: Attrs) -> Metas:
    a, b = metas
    _check_dtypes("rows_matmul", a, b)
    if a.ndim < 2 or a.shape[:-1] != b.shape[:-1]:
        raise ShapeError(
            f"op 'rows_matmul' needs a [..., k] and b [..., n] with equal leading axes (at least one), "
            f"got a {a} and b {b}"
        )
    return (TensorMeta((a.shape[-1], b.shape[-1]), a.dtype),)


def _rows_matmul_kernel(ctx: KernelContext, a: Any, b: Any) -> Any:
    # the reshapes and the matmul(transpose_a) it stands for, on the same arrays: the same GEMM call
    rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    return _gemm(ctx.xp, _swap_last(rows_a, True, ctx.xp), rows_b, ctx.out_array(0))


def _rows_matmul_grad(g: GradContext) -> list[Any]:
    a, b = g.inputs
    return [g.call("matmul", b, g.dy, transpose_b=True), g.call("matmul", a, g.dy)]


def _rows_matmul_flops(ins: Metas, outs: Metas, attrs: Attrs) -> int:
    return 2 * outs[0].numel * (ins[0].numel // ins[0].shape[-1])


defop(
    "rows_matmul",
    inputs=("a", "b"),
    infer=_rows_matmul_infer,
    rows=lambda m, a: rows.einsum(rows_matmul_spec(m[0].ndim)),
    kernel=_rows_matmul_kernel,
    grad=_rows_matmul_grad,
    doc="a [..., k] and b [..., n] as rows, a^T b [k, n]: matmul's weight gradient with its batch axes "
    "flattened (the fusion pass folds the two reshapes and the matmul of autodiff's rule into it)",
    flops=_rows_matmul_flops,
)


# ---- batch_matmul: a [..., m, k] @ b [..., k, n], equal batch axes --------------------------------------


def batch_matmul_spec(ndim: int, transpose_a: bool, transpose_b: bool) -> str:
    """``"abmk,abkn->abmn"``; the batch letters are kept, so attention heads split freely."""
    batch = _batch("batch_matmul", ndim)
    return f"{batch}{_mk(transpose_a)},{batch}{_kn(transpose_b)}->{batch}mn"


def _batch_matmul_infer(metas: Metas, attrs: Attrs) -> Metas:
    a, b = metas
    ta, tb = bool(attrs["transpose_a"]), bool(attrs["transpose_b"])
    _check_dtypes("batch_matmul", a, b)
    if a.ndim < 2 or a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2]:
        raise ShapeError(
            f"op 'batch_matmul' needs a [..., m, k] and b [..., k, n] with equal batch axes, got a {a} "
            f"and b {b}; it does not broadcast, so expand the smaller operand or use matmul for a 2-d b"
        )
    m, k_a = (a.shape[-1], a.shape[-2]) if ta else a.shape[-2:]
    k_b, n = (b.shape[-1], b.shape[-2]) if tb else b.shape[-2:]
    if k_a != k_b:
        raise ShapeError(
            f"op 'batch_matmul' contracts a {a} (transpose_a={ta}) with b {b} (transpose_b={tb}) "
            f"but their inner sizes differ: {k_a} vs {k_b}; check the transposes"
        )
    return (TensorMeta((*a.shape[:-2], m, n), a.dtype),)


def _batch_matmul_kernel(ctx: KernelContext, a: Any, b: Any) -> Any:
    xp = ctx.xp
    return _gemm(
        xp,
        _swap_last(a, bool(ctx.attrs["transpose_a"]), xp),
        _swap_last(b, bool(ctx.attrs["transpose_b"]), xp),
        ctx.out_array(0),
    )


# (transpose_a, transpose_b) -> how da and db are contractions of dy with the other operand:
# (first, second, transpose_a, transpose_b) names the batch_matmul that computes each gradient.
_BMM_GRADS: dict[tuple[bool, bool], tuple[tuple[str, str, bool, bool], tuple[str, str, bool, bool]]] = {
    (False, False): (("dy", "b", False, True), ("a", "dy", True, False)),  # da = dy b^T, db = a^T dy
    (False, True): (("dy", "b", False, False), ("dy", "a", True, False)),  # da = dy b,   db = dy^T a
    (True, False): (("b", "dy", False, True), ("a", "dy", False, False)),  # da = b dy^T, db = a dy
    (True, True): (("b", "dy", True, True), ("dy", "a", True, True)),  # da = b^T dy^T, db = dy^T a^T
}


def _batch_matmul_grad(g: GradContext) -> list[Any]:
    values = {"a": g.inputs[0], "b": g.inputs[1], "dy": g.dy}
    rules = _BMM_GRADS[bool(g.attrs["transpose_a"]), bool(g.attrs["transpose_b"])]
    return [
        g.call("batch_matmul", values[x], values[y], transpose_a=ta, transpose_b=tb) for x, y, ta, tb in rules
    ]


defop(
    "batch_matmul",
    inputs=("a", "b"),
    infer=_batch_matmul_infer,
    rows=lambda m, a: rows.einsum(
        batch_matmul_spec(m[0].ndim, bool(a["transpose_a"]), bool(a["transpose_b"]))
    ),
    kernel=_batch_matmul_kernel,
    grad=_batch_matmul_grad,
    attrs={"transpose_a": False, "transpose_b": False},
    doc="a [..., m, k] @ b [..., k, n] with equal batch axes (attention scores and values)",
    flops=_contraction_flops,
)
