"""Cases for sbpflow/ops/indexing.py, and flatten (a reshape of the trailing axes) for reshape.

References loop over positions with plain indexing (never ``np.take`` or a sort of the kernels' kind).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


def _indices(draw: st.DrawFn, n: int, max_dims: int = 2) -> np.ndarray:
    """Indices in [0, n) of 0-2 axes; few distinct values, so repeats are common."""
    shape = draw(shapes(0, max_dims, max_side=4))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, n, size=shape).astype(dtype)


# ---- gather --------------------------------------------------------------------------------------


@st.composite
def _gather(draw: st.DrawFn, backward: bool = False) -> Example:
    x_shape = draw(shapes(1, 3, max_side=5))
    axis = draw(st.integers(0, len(x_shape) - 1))
    indices = _indices(draw, x_shape[axis])
    if not backward:
        return Example((arrays(x_shape, draw), indices), {"axis": axis})
    dy = arrays((*x_shape[:axis], *indices.shape, *x_shape[axis + 1 :]), draw)
    return Example((dy, indices), {"axis": axis, "size": x_shape[axis]})


def _gather_ref(x: np.ndarray, indices: np.ndarray, axis: int = 0) -> list[np.ndarray]:
    pre, post = x.shape[:axis], x.shape[axis + 1 :]
    out = np.empty((*pre, *indices.shape, *post))
    for i in np.ndindex(*pre):
        for j in np.ndindex(*indices.shape):
            out[(*i, *j)] = x[(*i, int(indices[j]))]
    return [out]


def _gather_grad_ref(dy: np.ndarray, indices: np.ndarray, axis: int = 0, size: int = 1) -> list[np.ndarray]:
    m = indices.ndim
    pre, post = dy.shape[:axis], dy.shape[axis + m :]
    dx = np.zeros((*pre, size, *post))
    for i in np.ndindex(*pre):
        for j in np.ndindex(*indices.shape):
            dx[(*i, int(indices[j]))] += dy[(*i, *j)]
    return [dx]


case(OpCase("gather", _gather(), _gather_ref))
case(OpCase("gather_grad", _gather(backward=True), _gather_grad_ref, differentiable=()))


# ---- one_hot -------------------------------------------------------------------------------------


@st.composite
def _one_hot(draw: st.DrawFn) -> Example:
    depth = draw(st.integers(1, 7))
    indices = _indices(draw, depth + 2, max_dims=3) - 1  # some -1 and depth: rows of zeros
    return Example((indices,), {"depth": depth, "dtype": draw(st.sampled_from(["float32", "float64"]))})


def _one_hot_ref(indices: np.ndarray, depth: int, dtype: str = "float32") -> list[np.ndarray]:
    out = np.zeros((*indices.shape, depth), dtype=dtype)
    for j in np.ndindex(*indices.shape):
        if 0 <= indices[j] < depth:
            out[(*j, int(indices[j]))] = 1
    return [out]


case(OpCase("one_hot", _one_hot(), _one_hot_ref, differentiable=()))


# ---- topk ----------------------------------------------------------------------------------------


@st.composite
def _topk(draw: st.DrawFn, backward: bool = False) -> Example:
    shape = draw(shapes(1, 3, max_side=6))
    n = shape[-1]
    k = draw(st.integers(1, n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if backward:
        order = np.argsort(rng.random(shape), axis=-1)[..., :k]  # distinct positions in each row
        return Example((arrays((*shape[:-1], k), draw), order.astype(np.int64)), {"size": n})
    # distinct values 0.1 apart, so that finite differences never reorder a row; some rows with ties
    x = np.argsort(rng.random(shape), axis=-1) * 0.1 + rng.uniform(-0.01, 0.01, shape)
    if draw(st.booleans()):
        x = np.round(x, 0)
    return Example((x,), {"k": k})


def _topk_ref(x: np.ndarray, k: int) -> list[np.ndarray]:
    values, indices = np.empty((*x.shape[:-1], k)), np.empty((*x.shape[:-1], k), dtype=np.int64)
    for i in np.ndindex(*x.shape[:-1]):
        row = [float(v) for v in x[i]]
        best = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]  # ties: lower position first
        values[i], indices[i] = [row[j] for j in best], best
    return [values, indices]


def _topk_grad_ref(dy: np.ndarray, indices: np.ndarray, size: int) -> list[np.ndarray]:
    dx = np.zeros((*dy.shape[:-1], size))
    for pos in np.ndindex(*dy.shape):
        dx[(*pos[:-1], int(indices[pos]))] = dy[pos]
    return [dx]


@st.composite
def _topk_smooth(draw: st.DrawFn) -> Example:
    """Rows without ties, for the gradient: finite differences at a tie are meaningless."""
    example: Any = draw(_topk())
    (x,) = example.inputs
    if len(np.unique(x)) < x.size:
        x = np.argsort(np.argsort(x, axis=-1), axis=-1) * 0.1  # ranks 0.1 apart, no ties
    return Example((x,), example.attrs)


case(OpCase("topk", _topk(), _topk_ref, differentiable=()))
case(OpCase("topk", _topk_smooth(), _topk_ref, name="topk_grad_rule"))
case(OpCase("topk_grad", _topk(backward=True), _topk_grad_ref, differentiable=()))


# ---- flatten is reshape: the trailing axes from start_axis merged (NCHW -> [N, C*H*W]) ------------


@st.composite
def _flatten(draw: st.DrawFn) -> Example:
    shape = draw(shapes(2, 4, max_side=4))
    start = draw(st.integers(0, len(shape) - 1))
    flat = (*shape[:start], int(np.prod(shape[start:])))
    return Example((arrays(shape, draw),), {"shape": flat})


def _flatten_ref(x: np.ndarray, shape: tuple[int, ...]) -> list[np.ndarray]:
    out = np.empty(shape)
    inner = x.shape[len(shape) - 1 :]
    for i in np.ndindex(*x.shape):
        lead, rest = i[: len(shape) - 1], i[len(shape) - 1 :]
        out[(*lead, int(np.ravel_multi_index(rest, inner)))] = x[i]
    return [out]


case(OpCase("reshape", _flatten(), _flatten_ref, name="reshape_flatten"))
