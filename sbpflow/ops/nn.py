"""Neural-network ops: softmax, log_softmax, layer_norm, cross_entropy, and their backward ops.

Rows: these ops are nonlinear along the axis they normalise over, so that axis must be whole on every
rank (no split of it, never ``P`` in); any other axis may be split. The backward ops are linear in the
incoming gradient, so they also take ``P`` there while the saved forward values are ``B``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sbpflow.dtype import DType
from sbpflow.errors import ShapeError
from sbpflow.ops.base import Attrs, GradContext, KernelContext, Metas, NoGrad, Signature, defop, sig
from sbpflow.ops.kernels.rowwise import jit_rows, row_dot, row_max, row_mean, row_sum
from sbpflow.ops.reduction import normalize_axes
from sbpflow.ops.rows import all_broadcast
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta


def check_floats(op: str, **tensors: TensorMeta) -> None:
    for name, m in tensors.items():
        if not m.dtype.is_floating:
            raise ShapeError(f"op {op!r} needs a float {name}, got {m}; cast {name} to a float dtype first")
    dtypes = {m.dtype for m in tensors.values()}
    if len(dtypes) > 1:
        listed = ", ".join(f"{n} {m}" for n, m in tensors.items())
        raise ShapeError(f"op {op!r} needs one dtype for {listed}; cast them to one dtype")


def split_others(ndim: int, skip: int, n_in: int, n_out: int) -> list[Signature]:
    """Every input and output split alike along any axis but ``skip``; plus the replicated row."""
    rows = [sig([Split(i)] * n_in, [Split(i)] * n_out) for i in range(ndim) if i != skip]
    return [*rows, all_broadcast(n_in, n_out)]


def _axis(op: str, meta: TensorMeta, attrs: Attrs) -> int:
    return normalize_axes(op, meta.ndim, int(attrs["axis"]))[0]


# ---- softmax and log_softmax ---------------------------------------------------------------------


# The kernels below compute in arrays they own, with ``out=``, the operations of the formulas in their
# comments in the same order, without a temporary per operation. Along the last axis (every softmax of
# a GPT, layer norm and cross entropy) they reduce with rowwise.py, whose sums add in their own order
# (the last bit may differ from xp.sum's); along another axis with xp's own.


def _max(xp: Any, x: Any, axis: int) -> Any:
    return row_max(xp, x) if axis == x.ndim - 1 else xp.max(x, axis=axis, keepdims=True)


def _sum(xp: Any, x: Any, axis: int) -> Any:
    return row_sum(xp, x) if axis == x.ndim - 1 else xp.sum(x, axis=axis, keepdims=True)


def _dot(xp: Any, a: Any, b: Any, axis: int) -> Any:
    if axis == a.ndim - 1:
        return row_dot(xp, a, b)
    return xp.sum(xp.multiply(a, b), axis=axis, keepdims=True)


def _shifted(xp: Any, x: Any, axis: int, out: Any = None) -> Any:
    """x - max(x) along ``axis``, in a new C-contiguous array or ``out`` (the shift keeps exp from
    overflowing)."""
    return xp.subtract(x, _max(xp, x, axis), out=xp.empty(x.shape, dtype=x.dtype) if out is None else out)


def _rows(a: Any) -> Any:
    """``a`` as ``[rows, last axis]`` (a view: rows_jit's arrays are C-contiguous)."""
    return a.reshape(-1, a.shape[-1])


def _jit_out(xp: Any, out: Any, like: Any) -> Any:
    """``out`` (the runtime's dead buffer, or None) where it has ``like``'s shape, else a new array of it:
    rows_jit writes without bounds checks, so its output must match its input row for row."""
    return out if out is not None and out.shape == like.shape else xp.empty(like.shape, dtype=like.dtype)


def _softmax_kernel(ctx: KernelContext, x: Any) -> Any:
    # e / sum(e), e = exp(x - max x)
    xp = ctx.xp
    axis = _axis("softmax", ctx.in_metas[0], ctx.attrs)
    out = ctx.out_array(0)
    if axis == x.ndim - 1 and (jit := jit_rows(xp, x)) is not None:
        e = _jit_out(xp, out, x)
        jit.softmax_rows(_rows(x), _rows(e))
        return e
    e = _shifted(xp, x, axis, out)
    e = xp.exp(e, out=e)
    return xp.divide(e, _sum(xp, e, axis), out=e)


def _log_softmax_kernel(ctx: KernelContext, x: Any) -> Any:
    # s - log(sum(exp(s))), s = x - max x
    xp = ctx.xp
    axis = _axis("log_softmax", ctx.in_metas[0], ctx.attrs)
    if axis == x.ndim - 1 and (jit := jit_rows(xp, x)) is not None:
        out = xp.empty(x.shape, dtype=x.dtype)
        jit.log_softmax_rows(_rows(x), _rows(out))
        return out
    shifted = _shifted(xp, x, axis)
    lse = _sum(xp, xp.exp(shifted), axis)
    return xp.subtract(shifted, xp.log(lse, out=lse), out=shifted)


def _softmax_grad_kernel(ctx: KernelContext, y: Any, dy: Any) -> Any:
    # y (dy - sum(dy y))
    xp = ctx.xp
    axis = _axis("softmax_grad", ctx.in_metas[0], ctx.attrs)
    out = ctx.out_array(0)
    if axis == y.ndim - 1 and y.shape == dy.shape and (jit := jit_rows(xp, y, dy)) is not None:
        out = _jit_out(xp, out, y)
        jit.softmax_grad_rows(_rows(y), _rows(dy), _rows(out))
        return out
    p = xp.subtract(dy, _dot(xp, dy, y, axis), out=out)
    return xp.multiply(p, y, out=p)


def _log_softmax_grad_kernel(ctx: KernelContext, y: Any, dy: Any) -> Any:
    # dy - exp(y) sum(dy)
    xp = ctx.xp
    axis = _axis("log_softmax_grad", ctx.in_metas[0], ctx.attrs)
    if axis == y.ndim - 1 and y.shape == dy.shape and (jit := jit_rows(xp, y, dy)) is not None:
        out = xp.empty(y.shape, dtype=y.dtype)
        jit.log_softmax_grad_rows(_rows(y), _rows(dy), _rows(out))
        return out
    e = xp.exp(y)
    e = xp.multiply(e, _sum(xp, dy, axis), out=e)
    return xp.subtract(dy, e, out=e)


def _unary_infer(op: str) -> Callable[[Metas, Attrs], Metas]:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        check_floats(op, x=metas[0])
        _axis(op, metas[0], attrs)
        return (metas[0],)

    return infer


def _grad_infer(op: str) -> Callable[[Metas, Attrs], Metas]:
    def infer(metas: Metas, attrs: Attrs) -> Metas:
        y, dy = metas
        check_floats(op, y=y, dy=dy)
        if y.shape != dy.shape:
            raise ShapeError(f"op {op!r}: y {y} and dy {dy} must have one shape; pass the forward output")
        _axis(op, y, attrs)
        return (y,)

    return infer


def _grad_rows(op: str) -> Callable[[Metas, Attrs], list[Signature]]:
    def rows(metas: Metas, attrs: Attrs) -> list[Signature]:
        return [*split_others(metas[0].ndim, _axis(op, metas[0], attrs), 2, 1), sig([B, P], [P])]

    return rows


def _forward_rows(op: str) -> Callable[[Metas, Attrs], list[Signature]]:
    return lambda metas, attrs: split_others(metas[0].ndim, _axis(op, metas[0], attrs), 1, 1)


def _forward_grad(op: str) -> Callable[[GradContext], list[Any]]:
    # both backward ops read the forward output y, not x: nothing to recompute
    return lambda g: [g.call(f"{op}_grad", g.outputs[0], g.dy, axis=g.attrs["axis"])]


_SOFTMAXES = {  # forward op -> (forward kernel, backward kernel)
    "softmax": (_softmax_kernel, _softmax_grad_kernel),
    "log_softmax": (_log_softmax_kernel, _log_softmax_grad_kernel),
}

for _op, (_fwd, _bwd) in _SOFTMAXES.items():
    defop(
        _op,
        inputs=("x",),
        infer=_unary_infer(_op),
        rows=_forward_rows(_op),
        kernel=_fwd,
        grad=_forward_grad(_op),
        attrs={"axis": -1},
        doc=f"{_op} along `axis`, shifted by the max for stability",
        flops=5,  # max, subtract, exp, sum, divide
        fp32=True,  # exp overflows fp16, and the sum of exps loses its small terms
    )
    defop(
        f"{_op}_grad",
        inputs=("y", "dy"),
        outputs=("dx",),
        infer=_grad_infer(f"{_op}_grad"),
        rows=_grad_rows(f"{_op}_grad"),  # linear in dy: B, P -> P
        kernel=_bwd,
        grad=NoGrad(f"backward op of {_op}"),
        attrs={"axis": -1},
        doc=f"gradient of {_op} from its output y and the output gradient dy",
        flops=5,
    )


# ---- layer_norm ----------------------------------------------------------------------------------


def _check_params(op: str, x: TensorMeta, **params: TensorMeta) -> None:
    if x.ndim == 0:
        raise ShapeError(f"op {op!r} normalises the last axis; x {x} has none")
    for name, m in params.items():
        if m.shape != (x.shape[-1],):
            raise ShapeError(f"op {op!r}: {name} {m} must have shape [{x.shape[-1]}], the last axis of x {x}")


def _layer_norm_infer(metas: Metas, attrs: Attrs) -> Metas:
    x, w, b = metas
    check_floats("layer_norm", x=x, weight=w, bias=b)
    _check_params("layer_norm", x, weight=w, bias=b)
    return (x,)


def _normalize(xp: Any, x: Any, eps: float, out: Any = None) -> tuple[Any, Any]:
    """``(x - mean) * rstd`` over the last axis in a new array (or ``out``), and ``rstd`` (biased
    variance, as torch): one reduction for the mean, one pass to centre, one reduction for the variance,
    one pass to scale."""
    centered = xp.subtract(x, row_mean(xp, x), out=out)
    var = row_dot(xp, centered, centered)
    var = xp.divide(var, x.shape[-1], out=var)
    rstd = xp.sqrt(xp.add(var, x.dtype.type(eps), out=var), out=var)
    rstd = xp.divide(1.0, rstd, out=rstd)
    return xp.multiply(centered, rstd, out=centered), rstd


def _params_fit(x: Any, *params: Any) -> bool:
    """Whether each parameter is ``[D]`` for x's last axis D (rows_jit indexes without checking; a shard
    that does not fit takes the numpy kernel, which refuses it)."""
    return all(p.shape == x.shape[-1:] for p in params)


def _layer_norm_kernel(ctx: KernelContext, x: Any, w: Any, b: Any) -> Any:
    xp = ctx.xp
    out = ctx.out_array(0)
    if _params_fit(x, w, b) and (jit := jit_rows(xp, x, w, b)) is not None:
        out = _jit_out(xp, out, x)
        jit.layer_norm_rows(_rows(x), w, b, float(ctx.attrs["eps"]), _rows(out))
        return out
    y, _ = _normalize(xp, x, float(ctx.attrs["eps"]), out)  # xhat, then xhat * w + b in place
    return xp.add(xp.multiply(y, w, out=y), b, out=y)


defop(
    "layer_norm",
    inputs=("x", "weight", "bias"),
    infer=_layer_norm_infer,
    # split any leading axis of x with the parameters whole; y is affine in (weight, bias) jointly, so
    # partial parameters give a partial y (x must be whole: normalising is nonlinear)
    rows=lambda m, a: [
        *(sig([Split(i), B, B], [Split(i)]) for i in range(m[0].ndim - 1)),
        sig([B, P, P], [P]),
        all_broadcast(3, 1),
    ],
    kernel=_layer_norm_kernel,
    grad=lambda g: list(g.call_n("layer_norm_grad", g.dy, g.inputs[0], g.inputs[1], eps=g.attrs["eps"])),
    attrs={"eps": 1e-5},
    doc="normalise over the last axis, then scale by weight [D] and shift by bias [D]",
    flops=8,
    fp32=True,  # a mean and a variance over the row: sums
)


def _layer_norm_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, x, w = metas
    check_floats("layer_norm_grad", dy=dy, x=x, weight=w)
    if dy.shape != x.shape:
        raise ShapeError(f"op 'layer_norm_grad': dy {dy} and x {x} must have one shape")
    _check_params("layer_norm_grad", x, weight=w)
    return (x, w, w)


def _layer_norm_grad_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    # a split of the rows gives each rank part of the parameter gradients' sums over rows: P
    rows = [sig([Split(i), Split(i), B], [Split(i), P, P]) for i in range(metas[1].ndim - 1)]
    rows.append(sig([P, B, B], [P, P, P]))  # every output is linear in dy
    rows.append(sig([B, B, P], [P, B, B]))  # dx is linear in weight; dweight and dbias do not read it
    return [*rows, all_broadcast(3, 3)]


def _layer_norm_grad_kernel(ctx: KernelContext, dy: Any, x: Any, w: Any) -> tuple[Any, Any, Any]:
    """rstd (gx - mean(gx) - xhat mean(gx xhat)) with gx = dy w, in the kernel's two arrays (xhat and
    gx); dweight = sum(dy xhat) and dbias = sum(dy) over the rows."""
    xp = ctx.xp
    if dy.shape == x.shape and _params_fit(x, w) and (jit := jit_rows(xp, dy, x, w)) is not None:
        dx = _jit_out(xp, ctx.out_array(0), x)
        dw, db = xp.empty_like(w), xp.empty_like(w)
        jit.layer_norm_grad_rows(_rows(dy), _rows(x), w, float(ctx.attrs["eps"]), _rows(dx), dw, db)
        return dx, dw, db
    xhat, rstd = _normalize(xp, x, float(ctx.attrs["eps"]))
    dy_rows, xhat_rows = dy.reshape(-1, x.shape[-1]), xhat.reshape(-1, x.shape[-1])
    dbias = xp.einsum("ri->i", dy_rows)  # the parameters' sums over every row, without temporaries
    dweight = xp.einsum("ri,ri->i", dy_rows, xhat_rows)
    gx = xp.multiply(dy, w, out=ctx.out_array(0))  # w.r.t. xhat; then through the normalisation
    mean_g = row_mean(xp, gx)
    mean_gx = row_dot(xp, gx, xhat)
    mean_gx = xp.divide(mean_gx, x.shape[-1], out=mean_gx)
    dx = xp.subtract(gx, mean_g, out=gx)
    dx = xp.subtract(dx, xp.multiply(xhat, mean_gx, out=xhat), out=dx)
    return xp.multiply(dx, rstd, out=dx), dweight, dbias


defop(
    "layer_norm_grad",
    inputs=("dy", "x", "weight"),
    outputs=("dx", "dweight", "dbias"),
    infer=_layer_norm_grad_infer,
    rows=_layer_norm_grad_rows,
    kernel=_layer_norm_grad_kernel,
    grad=NoGrad("backward op of layer_norm"),
    attrs={"eps": 1e-5},
    doc="gradients of layer_norm w.r.t. x, weight and bias; recomputes the statistics from x",
    flops=12,
)


# ---- cross_entropy -------------------------------------------------------------------------------
# The class axis must be whole on each rank: a vocab-split logits tensor is gathered by boxing first.
# Vocabulary-parallel cross entropy (logits S(-1), Megatron's scheme) is four ops in vocab.py whose rows
# put the max and the sums across ranks into boxings of per-row statistics.

_LABEL_DTYPES = (DType.int32, DType.int64)


def check_ce(op: str, logits: TensorMeta, labels: TensorMeta) -> None:
    check_floats(op, logits=logits)
    if labels.dtype not in _LABEL_DTYPES:
        raise ShapeError(f"op {op!r}: labels {labels} must be int32 or int64 class indices; cast them")
    if logits.ndim == 0 or labels.shape != logits.shape[:-1]:
        raise ShapeError(
            f"op {op!r}: labels {labels} must have the shape of logits {logits} without its last "
            f"(class) axis, i.e. {list(logits.shape[:-1])}"
        )


def _ce_infer(metas: Metas, attrs: Attrs) -> Metas:
    logits, labels = metas
    check_ce("cross_entropy", logits, labels)
    return (TensorMeta(labels.shape, logits.dtype),)


def _ce_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    return split_others(metas[0].ndim, metas[0].ndim - 1, 2, 1)


def kept_rows(ctx: KernelContext, labels: Any) -> tuple[Any, Any]:
    """A mask of the positions that count, and labels with the ignored ones pointed at class 0."""
    kept = labels != int(ctx.attrs["ignore_index"])
    # labels outside 0..V-1 other than ignore_index are not checked here: that would sync the GPU
    return kept, ctx.xp.where(kept, labels, 0)


def _array(x: Any) -> Any:
    """``x`` as an ``out=`` target where it is an array (1-d logits reduce to a scalar: none)."""
    return x if getattr(x, "ndim", 0) else None


def _flat(xp: Any, a: Any) -> Any:
    """One value a row of logits (labels, the loss's gradient) as a C-contiguous 1-d array."""
    return xp.ascontiguousarray(a).reshape(-1)


def _labels_fit(logits: Any, labels: Any) -> bool:
    """Whether ``labels`` has one value per row of ``logits`` (else the numpy kernel refuses them)."""
    return getattr(labels, "shape", None) == logits.shape[:-1]


def _ce_kernel(ctx: KernelContext, logits: Any, labels: Any) -> Any:
    # where(kept, max + log(sum(exp(logits - max))) - logits[label], 0)
    xp = ctx.xp
    if _labels_fit(logits, labels) and (jit := jit_rows(xp, logits)) is not None:
        loss = xp.empty(logits.size // logits.shape[-1], dtype=logits.dtype)
        ignore = int(ctx.attrs["ignore_index"])
        if jit.cross_entropy_rows(_rows(logits), _flat(xp, labels), ignore, loss):
            return loss.reshape(labels.shape)
        # a label out of range: the numpy kernel below raises numpy's error for it
    kept, safe = kept_rows(ctx, labels)
    m = row_max(xp, logits)
    e = xp.subtract(logits, m)
    lse = row_sum(xp, xp.exp(e, out=e))[..., 0]
    lse = xp.add(m[..., 0], xp.log(lse, out=_array(lse)), out=_array(lse))
    picked = xp.take_along_axis(logits, safe[..., None].astype(xp.int64), axis=-1)[..., 0]
    loss = xp.where(kept, xp.subtract(lse, picked, out=_array(lse)), 0.0)
    return xp.asarray(loss).astype(logits.dtype, copy=False)


defop(
    "cross_entropy",
    inputs=("logits", "labels"),
    outputs=("loss",),
    infer=_ce_infer,
    rows=_ce_rows,
    kernel=_ce_kernel,
    grad=lambda g: [
        g.call("cross_entropy_grad", *g.inputs, g.dy, ignore_index=g.attrs["ignore_index"]),
        None,
    ],
    attrs={"ignore_index": -100},
    doc="per-position loss -log softmax(logits)[label]; 0 where label == ignore_index",
    flops=5,  # a softmax's max, subtract, exp, sum, divide
    fp32=True,  # a log of a sum of exps
)


def _ce_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    logits, labels, dy = metas
    check_ce("cross_entropy_grad", logits, labels)
    if dy.shape != labels.shape or dy.dtype != logits.dtype:
        raise ShapeError(
            f"op 'cross_entropy_grad': dy {dy} must be [{', '.join(map(str, labels.shape))}] "
            f"{logits.dtype.value}, the loss's shape and dtype"
        )
    return (logits,)


def _ce_grad_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    return [*split_others(metas[0].ndim, metas[0].ndim - 1, 3, 1), sig([B, B, P], [P])]  # linear in dy


def _ce_grad_kernel(ctx: KernelContext, logits: Any, labels: Any, dy: Any) -> Any:
    """e * (dy / sum(e)) - onehot * dy (dy zero where ignored), e = exp(logits - max): the onehot term
    is subtracted at the label of each row only (elsewhere it is a zero, and x - 0 == x)."""
    xp = ctx.xp
    fit = _labels_fit(logits, labels) and getattr(dy, "shape", None) == labels.shape
    if fit and (jit := jit_rows(xp, logits)) is not None:
        out = _jit_out(xp, ctx.out_array(0), logits)
        ignore = int(ctx.attrs["ignore_index"])
        jit.cross_entropy_grad_rows(_rows(logits), _flat(xp, labels), _flat(xp, dy), ignore, _rows(out))
        return out
    kept, safe = kept_rows(ctx, labels)
    n_classes = logits.shape[-1]
    e = _shifted(xp, logits, logits.ndim - 1)  # C-contiguous, so that rows below is a view of it
    e = xp.exp(e, out=e)
    dy_kept = xp.where(kept, dy, 0.0)
    e = xp.multiply(e, dy_kept[..., None] / row_sum(xp, e), out=e)
    # a label outside 0..V-1 (unchecked: see kept_rows) matches no class, so nothing is subtracted for it
    label = safe.reshape(-1)
    valid = (label >= 0) & (label < n_classes)
    rows = e.reshape(-1, n_classes)
    at = (xp.arange(rows.shape[0]), xp.where(valid, label, 0))
    rows[at] = rows[at] - xp.where(valid, dy_kept.reshape(-1), 0.0).astype(e.dtype, copy=False)
    return e


defop(
    "cross_entropy_grad",
    inputs=("logits", "labels", "dy"),
    outputs=("dlogits",),
    infer=_ce_grad_infer,
    rows=_ce_grad_rows,
    kernel=_ce_grad_kernel,
    grad=NoGrad("backward op of cross_entropy"),
    attrs={"ignore_index": -100},
    doc="(softmax(logits) - onehot(labels)) * dy[..., None], zero at ignored positions",
    flops=5,
)
