"""Cases for sbpflow/ops/shape.py.

References take the inputs positionally and the attributes by keyword, and use plain numpy indexing and
loops (never the kernels).
"""

from __future__ import annotations

from math import prod

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes

# ---- reshape -------------------------------------------------------------------------------------------


def _group(draw: st.DrawFn, factors: list[int]) -> tuple[int, ...]:
    """Multiply runs of neighbouring factors together (cut points drawn), sprinkling in size-1 axes."""
    out, run = [], factors[0]
    for f in factors[1:]:
        if draw(st.booleans()):
            out.append(run)
            run = f
        else:
            run *= f
    out.append(run)
    if draw(st.booleans()):
        out.insert(draw(st.integers(0, len(out))), 1)
    return tuple(out)


def _maybe_free(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Replace one size by -1 some of the time."""
    if not draw(st.booleans()):
        return shape
    i = draw(st.integers(0, len(shape) - 1))
    return (*shape[:i], -1, *shape[i + 1 :])


@st.composite
def _reshape_regroup(draw: st.DrawFn) -> Example:
    factors = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    src, dst = _group(draw, factors), _group(draw, factors)
    return Example((arrays(src, draw),), {"shape": _maybe_free(draw, dst)})


@st.composite
def _reshape_attention(draw: st.DrawFn) -> Example:
    """[B, T, 3D] <-> [B, T, 3, H, D/H] (the qkv split), [B, T, H, Dh] -> [B, T, D], [B, T, D] -> [B*T, D]."""
    b, t, h, dh = draw(shapes(4, 4, max_side=4))
    split, heads, merged = (b, t, 3 * h * dh), (b, t, 3, h, dh), (b * t, 3 * h * dh)
    src, dst = draw(
        st.sampled_from(
            [
                (split, heads),
                (heads, split),
                (split, merged),
                (merged, split),
                ((b, t, h, dh), (b, t, h * dh)),
            ]
        )
    )
    return Example((arrays(src, draw),), {"shape": _maybe_free(draw, dst)})


def _reshape_ref(x: np.ndarray, shape: tuple[int, ...]) -> list[np.ndarray]:
    free = [i for i, d in enumerate(shape) if d == -1]
    if free:
        shape = (*shape[: free[0]], x.size // -prod(shape), *shape[free[0] + 1 :])
    flat = x.ravel(order="C")
    return [np.array([flat[np.ravel_multi_index(ix, shape)] for ix in np.ndindex(*shape)]).reshape(shape)]


# ---- transpose, slice ----------------------------------------------------------------------------------


@st.composite
def _transpose(draw: st.DrawFn) -> Example:
    shape = draw(shapes(1, 4))
    perm = tuple(draw(st.permutations(range(len(shape)))))
    return Example((arrays(shape, draw),), {"perm": perm})


def _transpose_ref(x: np.ndarray, perm: tuple[int, ...]) -> list[np.ndarray]:
    out = np.empty(tuple(x.shape[p] for p in perm))
    for ix in np.ndindex(*x.shape):
        out[tuple(ix[p] for p in perm)] = x[ix]
    return [out]


def _bounds(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per axis: whole about half the time (so splits can pass), otherwise a random non-empty range."""
    starts, stops = [], []
    for d in shape:
        lo = 0 if draw(st.booleans()) else draw(st.integers(0, d - 1))
        hi = d if lo == 0 and draw(st.booleans()) else draw(st.integers(lo + 1, d))
        starts.append(lo)
        stops.append(hi)
    return tuple(starts), tuple(stops)


@st.composite
def _slice(draw: st.DrawFn) -> Example:
    shape = draw(shapes(1, 4))
    starts, stops = _bounds(draw, shape)
    return Example((arrays(shape, draw),), {"starts": starts, "stops": stops})


def _slice_ref(x: np.ndarray, starts: tuple[int, ...], stops: tuple[int, ...]) -> list[np.ndarray]:
    keep = np.ix_(*(np.arange(lo, hi) for lo, hi in zip(starts, stops, strict=True)))
    return [x[keep]]


@st.composite
def _slice_grad(draw: st.DrawFn) -> Example:
    shape = draw(shapes(1, 4))
    starts, stops = _bounds(draw, shape)
    dy = arrays(tuple(hi - lo for lo, hi in zip(starts, stops, strict=True)), draw)
    return Example((dy,), {"shape": shape, "starts": starts})


def _slice_grad_ref(dy: np.ndarray, shape: tuple[int, ...], starts: tuple[int, ...]) -> list[np.ndarray]:
    out = np.zeros(shape)
    for ix in np.ndindex(*dy.shape):
        out[tuple(i + lo for i, lo in zip(ix, starts, strict=True))] = dy[ix]
    return [out]


# ---- concat, split -------------------------------------------------------------------------------------


@st.composite
def _concat(draw: st.DrawFn) -> Example:
    shape = draw(shapes(1, 3))
    axis = draw(st.integers(0, len(shape) - 1))
    sizes = draw(st.lists(st.integers(1, 4), min_size=2, max_size=3))
    xs = tuple(arrays((*shape[:axis], s, *shape[axis + 1 :]), draw) for s in sizes)
    return Example(xs, {"axis": axis})


def _concat_ref(*xs: np.ndarray, axis: int) -> list[np.ndarray]:
    moved = [np.moveaxis(x, axis, 0) for x in xs]
    return [np.moveaxis(np.array([row for m in moved for row in m]), 0, axis)]


@st.composite
def _split(draw: st.DrawFn) -> Example:
    shape = draw(shapes(1, 3))
    axis = draw(st.integers(0, len(shape) - 1))
    cuts = sorted(draw(st.sets(st.integers(1, shape[axis] - 1), max_size=2))) if shape[axis] > 1 else []
    sizes = tuple(np.diff([0, *cuts, shape[axis]]).tolist())
    return Example((arrays(shape, draw),), {"axis": axis, "sizes": sizes})


def _split_ref(x: np.ndarray, axis: int, sizes: tuple[int, ...]) -> list[np.ndarray]:
    offsets = np.cumsum((0, *sizes))
    return [np.take(x, np.arange(lo, hi), axis=axis) for lo, hi in zip(offsets, offsets[1:], strict=False)]


# ---- embedding -----------------------------------------------------------------------------------------


def _ids(draw: st.DrawFn, vocab: int) -> np.ndarray:
    """ids of 1-3 axes; few distinct values, so repeats are common."""
    shape = draw(shapes(1, 3, max_side=5))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, vocab, size=shape).astype(dtype)


@st.composite
def _embedding(draw: st.DrawFn) -> Example:
    vocab = draw(st.sampled_from([1, 2, 5, 7, 8]))
    dim = draw(st.integers(1, 6))
    return Example((arrays((vocab, dim), draw), _ids(draw, vocab)))


def _embedding_ref(weight: np.ndarray, ids: np.ndarray) -> list[np.ndarray]:
    out = np.empty((*ids.shape, weight.shape[1]))
    for ix in np.ndindex(*ids.shape):
        out[ix] = weight[int(ids[ix])]
    return [out]


@st.composite
def _embedding_grad(draw: st.DrawFn) -> Example:
    vocab = draw(st.sampled_from([1, 2, 5, 7, 8]))
    ids = _ids(draw, vocab)
    dy = arrays((*ids.shape, draw(st.integers(1, 6))), draw)
    return Example((dy, ids), {"num_embeddings": vocab})


def _embedding_grad_ref(dy: np.ndarray, ids: np.ndarray, num_embeddings: int) -> list[np.ndarray]:
    out = np.zeros((num_embeddings, dy.shape[-1]))
    for ix in np.ndindex(*ids.shape):
        out[int(ids[ix])] += dy[ix]
    return [out]


case(OpCase("reshape", _reshape_regroup(), _reshape_ref))
case(OpCase("reshape", _reshape_attention(), _reshape_ref, name="reshape_attention"))
case(OpCase("transpose", _transpose(), _transpose_ref))
case(OpCase("slice", _slice(), _slice_ref))
case(OpCase("slice_grad", _slice_grad(), _slice_grad_ref, differentiable=()))
case(OpCase("concat", _concat(), _concat_ref, differentiable=(0, 1, 2)))
case(OpCase("split", _split(), _split_ref))
case(OpCase("embedding", _embedding(), _embedding_ref))
case(OpCase("embedding_grad", _embedding_grad(), _embedding_grad_ref, differentiable=()))
