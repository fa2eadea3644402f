"""Shape ops: reshape, transpose, slice, concat, split, and the embedding lookup (a gather of rows).

Rows: these ops move elements and do no arithmetic, so each is linear (``P -> P``) and runs replicated
(``B -> B``); a split survives where the op keeps the split axis whole, and it lands wherever the op
moves that axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate
from math import prod
from typing import Any, NoReturn

import numpy as np

from sbpflow.errors import ShapeError
from sbpflow.ops import rows
from sbpflow.ops.base import (
    REQUIRED,
    SHAPE_CACHE_SIZE,
    Attrs,
    GradContext,
    KernelContext,
    Metas,
    NoGrad,
    Signature,
    defop,
)
from sbpflow.ops.kernels.rowwise import jit_rows
from sbpflow.sbp import B, P, Split
from sbpflow.tensor_meta import Shape, TensorMeta


def moving_rows(n_in: int, n_out: int, axes: Sequence[tuple[int, int]]) -> list[Signature]:
    """Rows of a pure data movement: each (input axis, output axis) pair carries a split across."""
    out = [Signature((Split(i),) * n_in, (Split(j),) * n_out) for i, j in axes]
    out.append(rows.all_broadcast(n_in, n_out))
    out.append(Signature((P,) * n_in, (P,) * n_out))
    return out


def _axis(op: str, axis: Any, meta: TensorMeta) -> int:
    if not isinstance(axis, int) or not -meta.ndim <= axis < meta.ndim:
        raise ShapeError(f"op {op!r} got axis={axis!r} for x {meta}; use an axis in 0..{meta.ndim - 1}")
    return axis % meta.ndim


# ---- reshape -------------------------------------------------------------------------------------------


def resolve_shape(op: str, meta: TensorMeta, shape: Shape) -> Shape:
    """Fill in the one ``-1`` of ``shape`` so that it holds the elements of ``meta``."""
    free = [i for i, d in enumerate(shape) if d == -1]
    known = prod(d for d in shape if d != -1)
    if len(free) > 1 or any(d < -1 for d in shape):
        raise ShapeError(f"op {op!r} got shape={shape} for x {meta}; sizes are >= 0 with at most one -1")
    if free and known and meta.numel % known == 0:
        shape = (*shape[: free[0]], meta.numel // known, *shape[free[0] + 1 :])
    if prod(shape) != meta.numel or -1 in shape:
        raise ShapeError(
            f"op {op!r} cannot reshape x {meta} ({meta.numel} elements) to {list(shape)}; "
            "the sizes must multiply to the same count"
        )
    return tuple(shape)


def reshape_axes(src: Shape, dst: Shape) -> list[tuple[int, int]]:
    """(input axis, output axis) pairs that lead the same minimal group of merged or split axes.

    Splitting the leading axis of a group cuts the group's row-major range into contiguous chunks, the
    same chunks whichever side cuts it, so the split survives (when both sizes divide, which the
    framework checks for ``even_splits`` ops). Size-1 axes belong to no group: they are never split.
    """
    if 0 in src:
        return []
    ins = [i for i, d in enumerate(src) if d != 1]
    outs = [j for j, d in enumerate(dst) if d != 1]
    pairs, i, j = [], 0, 0
    while i < len(ins) and j < len(outs):
        pairs.append((ins[i], outs[j]))
        p, q = src[ins[i]], dst[outs[j]]
        while p != q:  # grow the smaller side until both sides hold the same elements
            if p < q:
                i += 1
                p *= src[ins[i]]
            else:
                j += 1
                q *= dst[outs[j]]
        i, j = i + 1, j + 1
    return pairs


def _reshape_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    return (TensorMeta(resolve_shape("reshape", x, tuple(attrs["shape"])), x.dtype),)  # type: ignore[arg-type]


defop(
    "reshape",
    inputs=("x",),
    infer=_reshape_infer,
    rows=lambda m, a: moving_rows(1, 1, reshape_axes(m[0].shape, _reshape_infer(m, a)[0].shape)),
    kernel=lambda ctx, x: x.reshape(ctx.out_shape(0)),
    grad=lambda g: [g.call("reshape", g.dy, shape=g.in_metas[0].shape)],
    attrs={"shape": REQUIRED},
    even_splits=True,  # a rank's local shape must be the local reshape of its input
    doc="x viewed with a new shape of the same element count (row-major); one size may be -1",
    flops=0,
    view=True,
)


# ---- transpose -----------------------------------------------------------------------------------------


def _perm(attrs: Attrs, x: TensorMeta) -> tuple[int, ...]:
    perm = tuple(attrs["perm"])  # type: ignore[arg-type]
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(
            f"op 'transpose' got perm={perm} for x {x}; give each axis 0..{x.ndim - 1} exactly once"
        )
    return perm


def _transpose_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    return (TensorMeta(tuple(x.shape[p] for p in _perm(attrs, x)), x.dtype),)


defop(
    "transpose",
    inputs=("x",),
    infer=_transpose_infer,
    rows=lambda m, a: moving_rows(1, 1, [(p, j) for j, p in enumerate(_perm(a, m[0]))]),
    kernel=lambda ctx, x: ctx.xp.transpose(x, ctx.attrs["perm"]),
    grad=lambda g: [g.call("transpose", g.dy, perm=tuple(np.argsort(g.attrs["perm"]).tolist()))],
    attrs={"perm": REQUIRED},
    doc="permute the axes: output axis j is input axis perm[j]",
    flops=0,
)


# ---- slice and its gradient ----------------------------------------------------------------------------


def _bounds(op: str, x: TensorMeta, starts: Any, stops: Any) -> list[tuple[int, int]]:
    if len(starts) != x.ndim or len(stops) != x.ndim:
        raise ShapeError(f"op {op!r} needs one start and one stop per axis of x {x}, got {starts}, {stops}")
    for a, (lo, hi, d) in enumerate(zip(starts, stops, x.shape, strict=True)):
        if not 0 <= lo <= hi <= d:
            raise ShapeError(
                f"op {op!r} got [{lo}, {hi}) on axis {a} of x {x}; bounds need 0 <= start <= stop <= {d}"
            )
    return list(zip(starts, stops, strict=True))


def _slice_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    bounds = _bounds("slice", x, attrs["starts"], attrs["stops"])
    return (TensorMeta(tuple(hi - lo for lo, hi in bounds), x.dtype),)


def _whole_axes(big: Shape, starts: Sequence[int], small: Shape) -> list[tuple[int, int]]:
    """Axes the slice leaves whole: only those may stay split (a cut axis would shift the shards)."""
    return [(a, a) for a, (d, lo, n) in enumerate(zip(big, starts, small, strict=True)) if lo == 0 and n == d]


def _cut(big: Shape, starts: Sequence[int], small: Shape) -> tuple[slice, ...]:
    """Where the small tensor lies in the big one, locally: whole axes (maybe split) are taken whole."""
    return tuple(
        slice(None) if lo == 0 and n == d else slice(lo, lo + n)
        for d, lo, n in zip(big, starts, small, strict=True)
    )


def _slice_kernel(ctx: KernelContext, x: Any) -> Any:
    return x[_cut(ctx.in_metas[0].shape, ctx.attrs["starts"], ctx.out_metas[0].shape)]  # type: ignore[arg-type]


defop(
    "slice",
    inputs=("x",),
    infer=_slice_infer,
    rows=lambda m, a: moving_rows(1, 1, _whole_axes(m[0].shape, a["starts"], _slice_infer(m, a)[0].shape)),  # type: ignore[arg-type]
    kernel=_slice_kernel,
    grad=lambda g: [g.call("slice_grad", g.dy, shape=g.in_metas[0].shape, starts=g.attrs["starts"])],
    attrs={"starts": REQUIRED, "stops": REQUIRED},
    doc="x[starts[0]:stops[0], starts[1]:stops[1], ...] (step 1, one bound pair per axis)",
    flops=0,
)


def _slice_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    (dy,) = metas
    shape, starts = tuple(attrs["shape"]), tuple(attrs["starts"])  # type: ignore[arg-type]
    out = TensorMeta(shape, dy.dtype)
    _bounds("slice_grad", out, starts, tuple(lo + n for lo, n in zip(starts, dy.shape, strict=False)))
    return (out,)


def _slice_grad_kernel(ctx: KernelContext, dy: Any) -> Any:
    out = ctx.out_zeros(0, dy.dtype)
    out[_cut(ctx.out_metas[0].shape, ctx.attrs["starts"], ctx.in_metas[0].shape)] = dy  # type: ignore[arg-type]
    return out


defop(
    "slice_grad",
    inputs=("dy",),
    infer=_slice_grad_infer,
    rows=lambda m, a: moving_rows(1, 1, _whole_axes(a["shape"], a["starts"], m[0].shape)),  # type: ignore[arg-type]
    kernel=_slice_grad_kernel,
    grad=NoGrad("backward op of slice"),
    attrs={"shape": REQUIRED, "starts": REQUIRED},
    doc="zeros of `shape` with dy written at `starts`: the gradient of slice",
    flops=0,
)


# ---- concat and split ----------------------------------------------------------------------------------


def _concat_infer(metas: Metas, attrs: Attrs) -> Metas:
    first = metas[0]
    axis = _axis("concat", attrs["axis"], first)
    for i, m in enumerate(metas):
        rest = m.shape[:axis] + m.shape[axis + 1 :]
        if (
            m.dtype != first.dtype
            or m.ndim != first.ndim
            or rest != first.shape[:axis] + first.shape[axis + 1 :]
        ):
            raise ShapeError(
                f"op 'concat' along axis {axis} got xs[0] {first} and xs[{i}] {m}; inputs need one dtype "
                "and equal sizes on every other axis"
            )
    size = sum(m.shape[axis] for m in metas)
    return (TensorMeta((*first.shape[:axis], size, *first.shape[axis + 1 :]), first.dtype),)


def _other_axes(meta: TensorMeta, axis: int) -> list[tuple[int, int]]:
    return [(a, a) for a in range(meta.ndim) if a != axis]


def _concat_grad(g: GradContext) -> list[Any]:
    axis = _axis("concat", g.attrs["axis"], g.in_metas[0])
    return list(g.call_n("split", g.dy, axis=axis, sizes=tuple(m.shape[axis] for m in g.in_metas)))


@lru_cache(maxsize=SHAPE_CACHE_SIZE)
def _concat_rows_of(shapes: tuple[Shape, ...], axis: int) -> tuple[Shape, int, tuple[int, ...]] | None:
    """concat of inputs of ``shapes`` along ``axis`` as rows: the output's shape, its rows (the axes before
    ``axis``) and each input's row width; None where the inputs differ off the axis (numpy's concatenate
    then refuses them: rows_jit reads without bounds checks). Worked out once per shapes."""
    lead, rest = shapes[0][:axis], shapes[0][axis + 1 :]
    if any(s[:axis] != lead or s[axis + 1 :] != rest for s in shapes):
        return None
    return (*lead, sum(s[axis] for s in shapes), *rest), prod(lead), tuple(prod(s[axis:]) for s in shapes)


def _concat_kernel(ctx: KernelContext, *xs: Any) -> Any:
    xp, axis, ndim = ctx.xp, int(ctx.attrs["axis"]), xs[0].ndim
    # an axis out of range, like a 0-d input, is numpy's to refuse
    plan = _concat_rows_of(tuple([x.shape for x in xs]), axis % ndim) if -ndim <= axis < ndim else None
    if plan is not None and (jit := jit_rows(xp, *xs)) is not None:  # one pass down the output
        shape, outer, widths = plan
        out = ctx.out_array(0)
        if out is None or out.shape != shape:
            out = xp.empty(shape, dtype=xs[0].dtype)
        jit.concat_rows(
            tuple([x.reshape(outer, w) for x, w in zip(xs, widths, strict=True)]), out.reshape(outer, -1)
        )
        return out
    if plan is not None and xp is np:
        # numpy lays its result out as the inputs lie: strided inputs (a transpose's view) gave a strided
        # result, which the next reshape copied again (the GPT's qkv gradient: ~0.1 ms a layer)
        out = ctx.out_array(0)
        if out is None or not out.flags.c_contiguous:
            out = np.empty(plan[0], dtype=xs[0].dtype)
        return np.concatenate(xs, axis=axis, out=out)
    return xp.concatenate(xs, axis=axis)


defop(
    "concat",
    inputs=("*xs",),
    infer=_concat_infer,
    rows=lambda m, a: moving_rows(len(m), 1, _other_axes(m[0], _axis("concat", a["axis"], m[0]))),
    kernel=_concat_kernel,
    grad=_concat_grad,
    attrs={"axis": REQUIRED},
    doc="join the inputs along `axis`",
    flops=0,
)


def _split_infer(metas: Metas, attrs: Attrs) -> Metas:
    (x,) = metas
    axis, sizes = _axis("split", attrs["axis"], x), tuple(attrs["sizes"])  # type: ignore[arg-type]
    if not sizes or any(s < 0 for s in sizes) or sum(sizes) != x.shape[axis]:
        raise ShapeError(
            f"op 'split' got sizes={sizes} for axis {axis} of x {x}; give non-negative sizes that add "
            f"up to {x.shape[axis]}"
        )
    return tuple(TensorMeta((*x.shape[:axis], s, *x.shape[axis + 1 :]), x.dtype) for s in sizes)


@lru_cache(maxsize=SHAPE_CACHE_SIZE)
def _split_indices(ndim: int, axis: int, sizes: tuple[int, ...]) -> tuple[tuple[slice, ...], ...]:
    """Each part's index into x: worked out once per (ndim, axis, sizes), not on every call (numpy's
    cumsum and tolist were a third of the kernel)."""
    head, bounds = (slice(None),) * (axis % ndim), list(accumulate(sizes, initial=0))
    return tuple((*head, slice(lo, hi)) for lo, hi in zip(bounds, bounds[1:], strict=False))


def _split_kernel(ctx: KernelContext, x: Any) -> tuple[Any, ...]:
    indices = _split_indices(x.ndim, int(ctx.attrs["axis"]), tuple(ctx.attrs["sizes"]))
    return tuple(x[ix] for ix in indices)


def _split_grad(g: GradContext) -> list[Any]:
    if all(d is None for d in g.grads):
        return [None]
    # an output that took no gradient contributes zeros to its part of dx
    return [g.call("concat", *g.grads_or_zeros(), axis=g.attrs["axis"])]


defop(
    "split",
    inputs=("x",),
    outputs=("*ys",),
    infer=_split_infer,
    rows=lambda m, a: moving_rows(
        1,
        len(tuple(a["sizes"])),
        _other_axes(m[0], _axis("split", a["axis"], m[0])),  # type: ignore[arg-type]
    ),
    kernel=_split_kernel,
    grad=_split_grad,
    attrs={"axis": REQUIRED, "sizes": REQUIRED},
    doc="cut x along `axis` into parts of the given sizes (one output each)",
    flops=0,
)


# ---- embedding: a gather of weight rows, and its scatter-add gradient ----------------------------------


def _embedding_infer(metas: Metas, attrs: Attrs) -> Metas:
    weight, ids = metas
    if weight.ndim != 2 or not weight.dtype.is_floating or ids.dtype.value not in ("int32", "int64"):
        raise ShapeError(
            f"op 'embedding' needs a float weight [V, D] and int32/int64 ids, got weight {weight} and "
            f"ids {ids}; cast ids with sf.cast(ids, sf.int64)"
        )
    return (TensorMeta((*ids.shape, weight.shape[1]), weight.dtype),)


_IDS = frozenset({np.dtype(np.int32), np.dtype(np.int64)})


def _int_rows(ids: Any) -> bool:
    """Whether rows_jit's gather may read ``ids``: a C-contiguous int32/int64 numpy array."""
    return isinstance(ids, np.ndarray) and ids.dtype in _IDS and ids.flags.c_contiguous


def in_range(xp: Any, ids: Any, rows_here: slice) -> tuple[Any, Any]:
    """ids relative to this rank's vocabulary rows, and which of them fall in its range."""
    local = ids - ids.dtype.type(rows_here.start)
    return local, (local >= 0) & (local < rows_here.stop - rows_here.start)


def check_ids(ids: Any, vocab: int, op: str) -> None:
    """Refuse an id outside ``[0, vocab)``: the data holds a token the model has no row for. (Under a
    vocabulary split each rank sees every id of its batch rows, so the check is the same on any layout.)
    On numpy only: on a GPU the check would wait for the device each step."""
    if isinstance(ids, np.ndarray) and ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            _outside(high if high >= vocab else low, vocab, op)


def _outside(bad: int, vocab: int, op: str) -> NoReturn:
    raise ShapeError(
        f"op {op!r}: id {bad} is outside the vocabulary [0, {vocab}): the data holds a token the model has "
        f"no row for; give ids below {vocab} (a tokenizer of that vocabulary, or a larger vocab_size)"
    )


def _embedding_kernel(ctx: KernelContext, weight: Any, ids: Any) -> Any:
    # under a vocabulary split (S(0) -> P) each rank looks up its own rows and writes zeros for the rest
    xp, vocab = ctx.xp, ctx.in_metas[0].shape[0]
    if _int_rows(ids) and (jit := jit_rows(xp, weight)) is not None and weight.ndim == 2:
        shape = (*ids.shape, weight.shape[1])
        out = ctx.out_array(0)  # the runtime's dead previous output, where it lends one
        if out is None or out.shape != shape:
            out = xp.empty(shape, dtype=weight.dtype)
        flat = ids.reshape(-1)  # the loop checks the ids against the vocabulary as it reads them
        at = jit.take_rows(
            weight, flat, ctx.in_index[0][0].start, vocab, out.reshape(ids.size, weight.shape[1])
        )
        if at >= 0:
            _outside(int(flat[at]), vocab, "embedding")
        return out
    check_ids(ids, vocab, "embedding")
    local, hit = in_range(xp, ids, ctx.in_index[0][0])
    if xp is np and hit.all():  # every id on this rank (always, unsplit): no zeros to write
        return np.take(weight, local, axis=0)
    found = xp.take(weight, xp.where(hit, local, 0), axis=0)
    return xp.where(hit[..., None], found, weight.dtype.type(0))


def _embedding_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    last = metas[1].ndim
    return [
        *(Signature((B, Split(i)), (Split(i),)) for i in range(last)),  # split the ids: batch parallel
        Signature((Split(1), B), (Split(last),)),  # split the features of every row
        Signature((Split(0), B), (P,)),  # vocabulary parallel (uneven is fine): zeros off this rank's rows
        Signature((P, B), (P,)),  # linear in weight
        rows.all_broadcast(2, 1),
    ]


defop(
    "embedding",
    inputs=("weight", "ids"),
    infer=_embedding_infer,
    rows=_embedding_rows,
    kernel=_embedding_kernel,
    grad=lambda g: [g.call("embedding_grad", g.dy, g.inputs[1], num_embeddings=g.in_metas[0].shape[0]), None],
    doc="weight[ids]: rows of weight [V, D] for ids of any shape -> [*ids.shape, D]",
    flops=0,
)


def _embedding_grad_infer(metas: Metas, attrs: Attrs) -> Metas:
    dy, ids = metas
    v = attrs["num_embeddings"]
    if dy.ndim != ids.ndim + 1 or dy.shape[:-1] != ids.shape or not isinstance(v, int) or v < 1:
        raise ShapeError(
            f"op 'embedding_grad' needs dy [*ids.shape, D] and num_embeddings >= 1, got dy {dy}, ids {ids}, "
            f"num_embeddings={v!r}"
        )
    return (TensorMeta((v, dy.shape[-1]), dy.dtype),)


def scatter_add(xp: Any, out: Any, index: Any, values: Any) -> None:
    """out[index] += values with repeated indices summed (numpy's ufunc.at; cupyx on cupy)."""
    if xp is np:
        if len(index):  # rows sorted by index, each run of one index summed: a sixth of np.add.at's time
            order = np.argsort(index, kind="stable")
            ordered = index[order]
            starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
            out[ordered[starts]] += np.add.reduceat(values[order], starts, axis=0)
    else:
        import cupyx  # only present where cupy is

        cupyx.scatter_add(out, index, values)


def _embedding_grad_kernel(ctx: KernelContext, dy: Any, ids: Any) -> Any:
    xp = ctx.xp
    out = ctx.out_zeros(0, dy.dtype)
    rows_dy = dy.reshape(-1, dy.shape[-1]) if dy.ndim else dy.reshape(1, 1)
    fits = ids.size == len(rows_dy) and out.shape[1:] == rows_dy.shape[1:]  # rows_jit does not bounds-check
    if fits and (jit := jit_rows(xp, rows_dy, out)) is not None:
        jit.add_rows_at(out, xp.ascontiguousarray(ids).reshape(-1), ctx.out_index[0][0].start, rows_dy)
        return out
    # under dy B -> S(0) each rank adds only the rows of its vocabulary range
    local, hit = in_range(xp, ids.reshape(-1), ctx.out_index[0][0])
    scatter_add(xp, out, local[hit], dy.reshape(-1, dy.shape[-1])[hit])
    return out


def _embedding_grad_rows(metas: Metas, attrs: Attrs) -> list[Signature]:
    last = metas[1].ndim
    return [
        *(Signature((Split(i), Split(i)), (P,)) for i in range(last)),  # each rank adds its ids' rows
        Signature((Split(last), B), (Split(1),)),
        Signature((B, B), (Split(0),)),  # vocabulary parallel: each rank keeps the rows it owns
        Signature((P, B), (P,)),
        rows.all_broadcast(2, 1),
    ]


defop(
    "embedding_grad",
    inputs=("dy", "ids"),
    infer=_embedding_grad_infer,
    rows=_embedding_grad_rows,
    kernel=_embedding_grad_kernel,
    grad=NoGrad("backward op of embedding"),
    attrs={"num_embeddings": REQUIRED},
    doc="dweight [V, D]: dy rows added at their ids (repeated ids add up)",
    flops=0,
)
