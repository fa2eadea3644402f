"""Cases for sbpflow/ops/reduction.py.

References take the inputs positionally and the attributes by keyword, and use plain numpy (never the
kernels); the gradient references loop over the kept positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes


def _norm(axes: Any, ndim: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(ndim))
    return tuple(sorted(a % ndim for a in ((axes,) if isinstance(axes, int) else axes)))


def _draw_axes(draw: st.DrawFn, ndim: int) -> Any:
    """None (all), or a random subset of the axes, each written positive or negative at random."""
    if draw(st.integers(0, 5)) == 0:
        return None
    picked = draw(st.lists(st.integers(0, ndim - 1), unique=True, max_size=ndim))
    return tuple(a - ndim if draw(st.booleans()) else a for a in picked)


def _distinct(draw: st.DrawFn, shape: tuple[int, ...]) -> np.ndarray:
    """Values at least 0.1 apart, so that max has no ties and finite differences do not cross one."""
    seed = draw(st.integers(0, 2**32 - 1))
    n = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(n).reshape(shape) - n / 2) * 0.1


@st.composite
def _reduce(draw: st.DrawFn, distinct: bool = False) -> Example:
    # max has no row for a reduced split axis, so its sharded rows need a kept axis of size >= 2
    shape = draw(shapes(min_side=2) if distinct else shapes())
    x = _distinct(draw, shape) if distinct else arrays(shape, draw)
    return Example((x,), {"axes": _draw_axes(draw, len(shape)), "keepdims": draw(st.booleans())})


def _reference(fn: Any) -> Any:
    def ref(x: np.ndarray, axes: Any = None, keepdims: bool = False) -> list[np.ndarray]:
        return [np.asarray(fn(x, axis=_norm(axes, x.ndim), keepdims=keepdims))]

    return ref


case(OpCase("sum", _reduce(), _reference(np.sum)))
case(OpCase("mean", _reduce(), _reference(np.mean)))
case(OpCase("max", _reduce(distinct=True), _reference(np.amax)))


def _keepdims_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _reduced(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    return (
        _keepdims_shape(shape, axes) if keepdims else tuple(d for i, d in enumerate(shape) if i not in axes)
    )


@st.composite
def _unreduce(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    axes, keepdims = _draw_axes(draw, len(shape)), draw(st.booleans())
    dy = arrays(_reduced(shape, _norm(axes, len(shape)), keepdims), draw)
    return Example((dy,), {"shape": shape, "axes": axes, "keepdims": keepdims})


def _per_kept(shape: tuple[int, ...], axes: tuple[int, ...]) -> Any:
    """Yield, for every kept position, the index into the keepdims-shaped array and into x."""
    for pos in np.ndindex(*_keepdims_shape(shape, axes)):
        yield pos, tuple(slice(None) if i in axes else p for i, p in enumerate(pos))


def _unreduce_ref(mean: bool) -> Any:
    def ref(dy: np.ndarray, shape: Any, axes: Any = None, keepdims: bool = False) -> list[np.ndarray]:
        ax = _norm(axes, len(shape))
        dyk = np.reshape(dy, _keepdims_shape(shape, ax))
        count = int(np.prod([shape[a] for a in ax]))
        dx = np.zeros(shape)
        for pos, region in _per_kept(shape, ax):
            dx[region] = dyk[pos] / (count if mean else 1)
        return [dx]

    return ref


case(OpCase("sum_grad", _unreduce(), _unreduce_ref(mean=False), differentiable=()))
case(OpCase("mean_grad", _unreduce(), _unreduce_ref(mean=True), differentiable=()))


def _channel_axes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """Batch norm's statistics: a shape of 3 or 4 axes and every axis but 1 (the channels), which
    norm_jit's plane loops reduce (mean) and broadcast back (mean_grad)."""
    shape = draw(shapes(min_dims=3, max_dims=4))
    return shape, (0, *range(2, len(shape))), draw(st.booleans())


@st.composite
def _channel_reduce(draw: st.DrawFn) -> Example:
    shape, axes, keepdims = _channel_axes(draw)
    return Example((arrays(shape, draw),), {"axes": axes, "keepdims": keepdims})


@st.composite
def _channel_unreduce(draw: st.DrawFn) -> Example:
    shape, axes, keepdims = _channel_axes(draw)
    dy = arrays(_reduced(shape, axes, keepdims), draw)
    return Example((dy,), {"shape": shape, "axes": axes, "keepdims": keepdims})


case(OpCase("mean", _channel_reduce(), _reference(np.mean), name="mean over all but channels"))
case(
    OpCase(
        "mean_grad",
        _channel_unreduce(),
        _unreduce_ref(mean=True),
        differentiable=(),
        name="mean_grad over all but channels",
    )
)


@st.composite
def _max_grad(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    axes, keepdims = _draw_axes(draw, len(shape)), draw(st.booleans())
    # few distinct values so that ties occur and the even split among them is exercised
    x = np.round(arrays(shape, draw, -1.0, 1.0))
    y = np.amax(x, axis=_norm(axes, len(shape)), keepdims=keepdims)
    dy = arrays(y.shape, draw)
    return Example((dy, x, np.asarray(y)), {"axes": axes, "keepdims": keepdims})


def _max_grad_ref(
    dy: np.ndarray, x: np.ndarray, y: np.ndarray, axes: Any = None, keepdims: bool = False
) -> list:
    ax = _norm(axes, x.ndim)
    dyk = np.reshape(dy, _keepdims_shape(x.shape, ax))
    dx = np.zeros_like(x)
    for pos, region in _per_kept(x.shape, ax):
        block = x[region]
        hits = block == block.max()
        dx[region] = np.where(hits, dyk[pos] / hits.sum(), 0.0)
    return [dx]


case(OpCase("max_grad", _max_grad(), _max_grad_ref, differentiable=()))


@st.composite
def _broadcast_pair(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A shape and a smaller one that broadcasts to it (leading axes dropped, some sizes set to 1)."""
    big = draw(shapes())
    k = draw(st.integers(0, len(big)))
    small = tuple(1 if draw(st.booleans()) else d for d in big[k:])
    return big, small


@st.composite
def _sum_to(draw: st.DrawFn) -> Example:
    big, small = draw(_broadcast_pair())
    return Example((arrays(big, draw),), {"shape": small})


@st.composite
def _broadcast_to(draw: st.DrawFn) -> Example:
    big, small = draw(_broadcast_pair())
    return Example((arrays(small, draw),), {"shape": big})


def _sum_to_ref(x: np.ndarray, shape: Any) -> list[np.ndarray]:
    out = x
    while out.ndim > len(shape):  # the leading axes numpy would have added
        out = out.sum(axis=0)
    for a, s in enumerate(shape):
        if s == 1:
            out = out.sum(axis=a, keepdims=True)
    return [out.reshape(shape)]


def _broadcast_to_ref(x: np.ndarray, shape: Any) -> list[np.ndarray]:
    return [x + np.zeros(shape)]


case(OpCase("sum_to", _sum_to(), _sum_to_ref))
case(OpCase("broadcast_to", _broadcast_to(), _broadcast_to_ref))
