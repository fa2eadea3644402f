"""Vocabulary-parallel cross entropy: the loss on logits split along their class axis, never gathered.

``cross_entropy`` needs whole rows; with the head's weight column-split (Megatron's output layer) the
logits [..., V] are ``S(-1)`` and gathering them costs (p-1)|logits|. Kernels do not communicate, so the
loss is three ops whose SBP rows carry the cross-rank reductions as boxings of per-row tensors:

1. ``vocab_chunk_max`` -- the maximum of each of ``chunks`` equal slices of the class axis: [..., C].
   A rank holding whole chunks (``S(-1) -> S(-1)``, even splits) finds its own; their maximum, once the
   [..., C] maxima are gathered, is the row's maximum: the shift that keeps ``exp`` from overflowing.
   There is no partial-max SBP, so this stage is an all-gather of C values a row, not an all-reduce.
2. ``vocab_terms`` -- per row, the sum of ``exp(logits - max)`` and the logit at the label. On a
   vocabulary shard both are partial sums (``S(-1) -> P``): the sum of the shard's terms, and the label's
   logit where this rank holds it, 0 elsewhere. Boxing all-reduces them.
3. ``vocab_cross_entropy`` -- ``max + log(sum) - target`` where the label counts, 0 elsewhere. With a
   partial target it is itself partial: the rank at class offset 0 adds ``max + log(sum)``, every rank
   subtracts its share of the target (it reads the logits for that offset only).

The gradients hold the shift constant (the loss's derivatives through it cancel): ``vocab_cross_entropy``
gives ``dy / sum`` and ``-dy`` (``vocab_cross_entropy_grad``, per row), and ``vocab_terms_grad`` turns them
into ``exp(logits - max) dsum + onehot(label) dtarget`` on the rank's own classes (``S(-1) -> S(-1)``), so
the backward moves nothing of size V. Under data parallelism or on one device every op runs on whole
rows, and the loss equals ``cross_entropy``'s to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from sbpflow.errors import ShapeError
from sbpflow.ops.base import REQUIRED, Attrs, KernelContext, Metas, NoGrad, Signature, defop, get_op, sig
from sbpflow.ops.kernels.rowwise import jit_rows, row_max
from sbpflow.ops.nn import check_ce, check_floats, kept_rows
from sbpflow.ops.rows import all_broadcast
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import TensorMeta


def _chunks(op: str, logits: TensorMeta, attrs: Attrs) -> int:
    c = attrs["chunks"]
    if not isinstance(c, int) or isinstance(c, bool) or c < 1 or logits.shape[-1] % c:
        raise ShapeError(
            f"op {op!r}: chunks={c!r} must be a positive int that divides the {logits.shape[-1]} classes "
            f"of logits {logits}; use the tensor-parallel degree, or 1"
        )
    return c


def _batch_rows(ndim: int, n_in: int, n_out: int) -> list[Signature]:
    """Every tensor split alike along one of the logits' leading (row) axes."""
    return [sig([Split(i)] * n_in, [Split(i)] * n_out) for i in range(ndim - 1)]


def _shift(xp: Any, chunk_max: Any) -> Any:
    """The row's maximum [..., 1] from its chunks' maxima (whole on every rank)."""
    return row_max(xp, chunk_max)


def _check_stats(op: str, logits: TensorMeta, **stats: TensorMeta) -> None:
    """Each statistic has the logits' rows (chunk_max one more axis, of its chunks) and their dtype."""
    for name, m in stats.items():
        rows = m.shape[:-1] if name == "chunk_max" else m.shape
        if (
            rows != logits.shape[:-1]
            or m.ndim != logits.ndim - (name != "chunk_max")
            or m.dtype != logits.dtype
        ):
            raise ShapeError(
                f"op {op!r}: {name} {m} does not fit logits {logits}: it must have the rows "
                f"{list(logits.shape[:-1])} and dtype {logits.dtype.value}; pass the statistics of these logits"
            )


def _with_stats(op: str, out: Callable[[Metas], Metas]) -> Callable[[Metas, Attrs], Metas]:
    """The inference of an op reading (logits, labels, chunk_max, *per-row tensors): check, then ``out``."""

    def infer(metas: Metas, attrs: Attrs) -> Metas:
        check_ce(op, metas[0], metas[1])
        _check_stats(op, metas[0], **dict(zip(get_op(op).inputs[2:], metas[2:], strict=True)))
        return out(metas)

    return infer


_LABELS = frozenset({np.dtype(np.int32), np.dtype(np.int64)})


def _jit_stats(xp: Any, labels: Any, *stats: Any) -> ModuleType | None:
    """rows_jit, where its loops over the loss's per-row statistics may run: ``jit_rows``' conditions on
    the float statistics (each of the labels' shape), and C-contiguous int32/int64 labels. The loops read
    and write one value a label without bounds checks. These ops were a few numpy calls on [rows] arrays
    each, and the Python between the calls was their cost: so are these checks, kept to tuple compares."""
    if not isinstance(labels, np.ndarray) or labels.dtype not in _LABELS or not labels.flags.c_contiguous:
        return None
    rows = labels.shape
    for s in stats:
        if s.shape != rows:
            return None
    return jit_rows(xp, *stats)


def _maxima_fit(chunk_max: Any, labels: Any, like: Any) -> bool:
    """Whether the loss's loop may read ``chunk_max`` as a row of maxima a label: a C-contiguous numpy
    array [*labels.shape, C > 0] of the statistics' dtype."""
    return (
        isinstance(chunk_max, np.ndarray)
        and chunk_max.shape[:-1] == labels.shape
        and chunk_max.shape[-1:] > (0,)
        and chunk_max.dtype == like.dtype
        and chunk_max.flags.c_contiguous
    )


def _rows_of(metas: Metas) -> TensorMeta:
    return TensorMeta(metas[1].shape, metas[0].dtype)


# ---- 1. the maximum of each chunk of the class axis ---------------------------------------------------


def _chunk_max_infer(metas: Metas, attrs: Attrs) -> Metas:
    (logits,) = metas
    check_floats("vocab_chunk_max", logits=logits)
    if logits.ndim < 2:
        raise ShapeError(f"op 'vocab_chunk_max' needs logits [..., V] with a row axis, got {logits}")
    return (TensorMeta((*logits.shape[:-1], _chunks("vocab_chunk_max", logits, attrs)), logits.dtype),)


def _chunk_max_kernel(ctx: KernelContext, logits: Any) -> Any:
    here = ctx.out_shape(0)[-1]  # the chunks this rank holds, whole (even splits)
    if (jit := jit_rows(ctx.xp, logits)) is not None:  # each chunk a row of rows_jit.max_rows
        out = ctx.xp.empty((*logits.shape[:-1], here), dtype=logits.dtype)
        jit.max_rows(logits.reshape(-1, logits.shape[-1] // here), out.reshape(-1))
        return out
    rows = logits.reshape(*logits.shape[:-1], here, logits.shape[-1] // here)
    return row_max(ctx.xp, rows)[..., 0]


defop(
    "vocab_chunk_max",
    inputs=("logits",),
    outputs=("chunk_max",),
    infer=_chunk_max_infer,
    # a vocabulary shard is whole chunks when both split evenly (V = C k, p | C): each rank finds its own
    rows=lambda m, a: [
        *_batch_rows(m[0].ndim, 1, 1),
        sig([Split(m[0].ndim - 1)], [Split(m[0].ndim - 1)]),
        sig([B], [B]),
    ],
    kernel=_chunk_max_kernel,
    grad=NoGrad("a stability shift: the cross entropy does not depend on it"),
    attrs={"chunks": REQUIRED},
    even_splits=True,
    doc="max of each of `chunks` equal slices of the last axis: [..., V] -> [..., chunks]",
    flops=5,
)


# ---- 2. the sum of exponentials and the label's logit, partial on a vocabulary shard --------------------


def _label_here(ctx: KernelContext, logits: Any, labels: Any) -> tuple[Any, Any]:
    """Labels relative to this rank's classes, and where the label counts and lies among them."""
    xp = ctx.xp
    kept, safe = kept_rows(ctx, labels)
    local = safe - safe.dtype.type(ctx.in_offset(0, logits.ndim - 1))
    hit = kept & (local >= 0) & (local < logits.shape[-1])
    return xp.where(hit, local, 0), hit


def _jit_terms(ctx: KernelContext, logits: Any, labels: Any, chunk_max: Any, *stats: Any) -> Any:
    """rows_jit where its vocab_terms loops may run (``_jit_stats``, the logits and chunk maxima as
    C-contiguous rows of the statistics' dtype), with the loops' common arguments; else None."""
    if (
        getattr(logits, "shape", ())[:-1] != getattr(labels, "shape", None)
        or not _maxima_fit(chunk_max, labels, logits)
        or (jit := _jit_stats(ctx.xp, labels, *stats)) is None
        or jit_rows(ctx.xp, logits) is None
    ):
        return None
    n = logits.shape[-1]
    rows = (logits.reshape(-1, n), chunk_max.reshape(-1, chunk_max.shape[-1]))
    return (
        jit,
        rows,
        int(ctx.in_offset(0, logits.ndim - 1)),
        labels.reshape(-1),
        int(ctx.attrs["ignore_index"]),
    )


def _terms_kernel(ctx: KernelContext, logits: Any, labels: Any, chunk_max: Any) -> tuple[Any, Any]:
    # sum(exp(logits - max)) over this rank's classes; logits[label] where this rank holds the label, else 0
    xp = ctx.xp
    sum_exp, target = (xp.empty(labels.shape, dtype=logits.dtype) for _ in range(2))
    if (fit := _jit_terms(ctx, logits, labels, chunk_max, sum_exp, target)) is not None:
        jit, (x, cm), offset, flat, ignore = fit
        jit.vocab_terms_rows(x, cm, offset, flat, ignore, sum_exp.reshape(-1), target.reshape(-1))
        return sum_exp, target
    e = xp.exp(xp.subtract(logits, _shift(xp, chunk_max)))
    sum_exp = xp.einsum("...i->...", e)
    local, hit = _label_here(ctx, logits, labels)
    picked = xp.take_along_axis(logits, local[..., None].astype(xp.int64), axis=-1)[..., 0]
    target = xp.where(hit, picked, logits.dtype.type(0))
    return xp.asarray(sum_exp), xp.asarray(target).astype(logits.dtype, copy=False)


defop(
    "vocab_terms",
    inputs=("logits", "labels", "chunk_max"),
    outputs=("sum_exp", "target"),
    infer=_with_stats("vocab_terms", lambda m: (_rows_of(m), _rows_of(m))),
    rows=lambda m, a: [
        *_batch_rows(m[0].ndim, 3, 2),
        sig([Split(m[0].ndim - 1), B, B], [P, P]),  # a shard's terms, and its label's logit or 0: sums
        all_broadcast(3, 2),
    ],
    kernel=_terms_kernel,
    # the shift is held constant: the loss's derivatives through it cancel (d/dmax of max + log sum = 0)
    grad=lambda g: [
        g.call("vocab_terms_grad", *g.inputs, *g.grads, ignore_index=g.attrs["ignore_index"]),
        None,
        None,
    ],
    attrs={"ignore_index": -100},
    doc="per row: sum(exp(logits - max(chunk_max))) and logits[label] (0 where ignored)",
    flops=5,
)


def _terms_grad_kernel(
    ctx: KernelContext, logits: Any, labels: Any, chunk_max: Any, dsum: Any, dtarget: Any
) -> Any:
    # exp(logits - max) dsum, plus dtarget at the label where this rank holds it
    xp = ctx.xp
    if (fit := _jit_terms(ctx, logits, labels, chunk_max, dsum, dtarget)) is not None:
        jit, (x, cm), offset, flat, ignore = fit
        out = xp.empty_like(logits)
        n = logits.shape[-1]
        jit.vocab_terms_grad_rows(
            x, cm, offset, flat, ignore, dsum.reshape(-1), dtarget.reshape(-1), out.reshape(-1, n)
        )
        return out
    e = xp.exp(xp.subtract(logits, _shift(xp, chunk_max)))
    e = xp.multiply(e, dsum[..., None], out=e)
    local, hit = _label_here(ctx, logits, labels)
    rows = e.reshape(-1, logits.shape[-1])
    at = (xp.arange(rows.shape[0]), local.reshape(-1))
    rows[at] = rows[at] + xp.where(hit, dtarget, 0.0).reshape(-1).astype(e.dtype, copy=False)
    return e


defop(
    "vocab_terms_grad",
    inputs=("logits", "labels", "chunk_max", "dsum", "dtarget"),
    outputs=("dlogits",),
    infer=_with_stats("vocab_terms_grad", lambda m: (m[0],)),
    rows=lambda m, a: [
        *_batch_rows(m[0].ndim, 5, 1),
        sig([Split(m[0].ndim - 1), B, B, B, B], [Split(m[0].ndim - 1)]),  # each rank its own classes
        sig([B, B, B, P, P], [P]),  # linear in (dsum, dtarget)
        all_broadcast(5, 1),
    ],
    kernel=_terms_grad_kernel,
    grad=NoGrad("backward op of vocab_terms"),
    attrs={"ignore_index": -100},
    doc="dlogits = exp(logits - max(chunk_max)) * dsum + onehot(labels) * dtarget",
    flops=5,
)


# ---- 3. the loss from the statistics ---------------------------------------------------------------


def _ce_kernel(
    ctx: KernelContext, logits: Any, labels: Any, chunk_max: Any, sum_exp: Any, target: Any
) -> Any:
    # where(kept, max + log(sum_exp) - target, 0). With a partial target (logits split by class) only the
    # rank at class offset 0 adds max + log(sum_exp); every signature with whole logits has offset 0
    xp = ctx.xp
    first = ctx.in_offset(0, logits.ndim - 1) == 0
    if _maxima_fit(chunk_max, labels, sum_exp) and (jit := _jit_stats(xp, labels, sum_exp, target)):
        loss = xp.empty(labels.shape, dtype=sum_exp.dtype)
        jit.vocab_loss_rows(labels, chunk_max, sum_exp, target, int(ctx.attrs["ignore_index"]), first, loss)
        return loss
    kept, _ = kept_rows(ctx, labels)
    if first:
        loss = xp.subtract(xp.add(_shift(xp, chunk_max)[..., 0], xp.log(sum_exp)), target)
    else:
        loss = xp.negative(target)
    return xp.asarray(xp.where(kept, loss, 0.0)).astype(logits.dtype, copy=False)


defop(
    "vocab_cross_entropy",
    inputs=("logits", "labels", "chunk_max", "sum_exp", "target"),
    outputs=("loss",),
    infer=_with_stats("vocab_cross_entropy", lambda m: (_rows_of(m),)),
    rows=lambda m, a: [
        *_batch_rows(m[0].ndim, 5, 1),
        # the logits only say which rank adds max + log(sum_exp): linear in the target, partial with it
        sig([Split(m[0].ndim - 1), B, B, B, P], [P]),
        all_broadcast(5, 1),
    ],
    kernel=_ce_kernel,
    grad=lambda g: [
        None,
        None,
        None,
        *g.call_n(
            "vocab_cross_entropy_grad", g.inputs[1], g.inputs[3], g.dy, ignore_index=g.attrs["ignore_index"]
        ),
    ],
    attrs={"ignore_index": -100},
    doc="per-position max(chunk_max) + log(sum_exp) - target (0 where ignored): vocab_terms' cross entropy",
    flops=5,
)


def _ce_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    labels, sum_exp, dy = metas
    if labels.shape != sum_exp.shape or dy != sum_exp or not sum_exp.dtype.is_floating:
        raise ShapeError(
            f"op 'vocab_cross_entropy_grad': labels {labels}, sum_exp {sum_exp} and dy {dy} must share one "
            "shape, sum_exp and dy one float dtype; pass the loss's statistics and its gradient"
        )
    return (dy, dy)


def _ce_grad_kernel(ctx: KernelContext, labels: Any, sum_exp: Any, dy: Any) -> tuple[Any, Any]:
    # dsum = dy / sum_exp, dtarget = -dy, both 0 where the label is ignored
    xp = ctx.xp
    if (jit := _jit_stats(xp, labels, sum_exp, dy)) is not None:
        dsum, dtarget = xp.empty(labels.shape, dtype=dy.dtype), xp.empty(labels.shape, dtype=dy.dtype)
        jit.vocab_loss_grad_rows(labels, sum_exp, dy, int(ctx.attrs["ignore_index"]), dsum, dtarget)
        return dsum, dtarget
    kept, _ = kept_rows(ctx, labels)
    dy_kept = xp.where(kept, dy, 0.0).astype(dy.dtype, copy=False)
    return xp.divide(dy_kept, sum_exp), xp.negative(dy_kept)


defop(
    "vocab_cross_entropy_grad",
    inputs=("labels", "sum_exp", "dy"),
    outputs=("dsum", "dtarget"),
    infer=_ce_grad_infer,
    rows=lambda m, a: [
        *(sig([Split(i)] * 3, [Split(i)] * 2) for i in range(m[0].ndim)),
        sig([B, B, P], [P, P]),  # linear in dy
        all_broadcast(3, 2),
    ],
    kernel=_ce_grad_kernel,
    grad=NoGrad("backward op of vocab_cross_entropy"),
    attrs={"ignore_index": -100},
    doc="the loss's gradients w.r.t. sum_exp (dy / sum_exp) and target (-dy), 0 where ignored",
    flops=5,
)
