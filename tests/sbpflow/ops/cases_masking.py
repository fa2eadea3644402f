"""Cases for sbpflow/ops/masking.py.

References are plain numpy formulas (never the kernels). Random ops are referenced at seed 0, step 0,
the eager builder's default.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from sbpflow.dtype import DType
from sbpflow.random import RandomKey, bernoulli_mask
from tests.sbpflow.ops.cases import Example, OpCase, arrays, case, shapes
from tests.sbpflow.ops.cases_elementwise import broadcastable

# ---- masks and selection --------------------------------------------------------------------------------


# Huge fills (-1e9, the default -1e30) get cases of their own without a finite-difference check: a
# perturbation of 1e-6 is lost beside them in the float64 sum that the check differentiates.
_small_fills = st.sampled_from([0.0, 2.5, -3.0])
_huge_fills = st.sampled_from([-1e9, -1e30])


@st.composite
def _masked(draw: st.DrawFn, fills: st.SearchStrategy[float]) -> Example:
    shape = draw(shapes())
    mask = arrays(broadcastable(draw, shape), draw) > 0
    return Example((arrays(shape, draw), mask), {"value": draw(fills)})


def _masked_fill_reference(x: np.ndarray, mask: np.ndarray, value: float) -> list[np.ndarray]:
    out = x.copy()
    out[np.broadcast_to(mask, x.shape)] = value
    return [out]


case(OpCase("masked_fill", _masked(_small_fills), _masked_fill_reference))
case(
    OpCase(
        "masked_fill",
        _masked(_huge_fills),
        _masked_fill_reference,
        differentiable=(),
        name="masked_fill/huge",
    )
)


@st.composite
def _attention_scores(draw: st.DrawFn, fills: st.SearchStrategy[float] | None) -> Example:
    shape = draw(shapes(min_dims=2, max_dims=4))
    return Example((arrays(shape, draw),), {} if fills is None else {"value": draw(fills)})


def _causal_reference(x: np.ndarray, value: float = -1e30) -> list[np.ndarray]:
    out = x.copy()
    for q in range(x.shape[-2]):
        for k in range(x.shape[-1]):
            if k > q:
                out[..., q, k] = value
    return [out]


case(OpCase("causal_mask", _attention_scores(_small_fills), _causal_reference))
case(
    OpCase(
        "causal_mask",
        _attention_scores(None),
        _causal_reference,
        differentiable=(),
        name="causal_mask/default",
    )
)


@st.composite
def _where(draw: st.DrawFn) -> Example:
    shape = draw(shapes())
    cond, a, b = (broadcastable(draw, shape) if draw(st.booleans()) else shape for _ in range(3))
    return Example((arrays(cond, draw) > 0, arrays(a, draw), arrays(b, draw)))


def _where_reference(cond: np.ndarray, a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
    shape = np.broadcast_shapes(cond.shape, a.shape, b.shape)
    out = np.broadcast_to(b, shape).copy()
    out[np.broadcast_to(cond, shape)] = np.broadcast_to(a, shape)[np.broadcast_to(cond, shape)]
    return [out]


case(OpCase("where", _where(), _where_reference, differentiable=(1, 2)))

# ---- random and creation --------------------------------------------------------------------------------


@st.composite
def _dropout(draw: st.DrawFn) -> Example:
    attrs = {"rate": draw(st.sampled_from([0.0, 0.1, 0.5, 0.9])), "rng_id": draw(st.integers(0, 2**32 - 1))}
    return Example((arrays(draw(shapes(max_dims=4)), draw),), attrs)


def _dropout_reference(x: np.ndarray, rate: float, rng_id: int) -> list[np.ndarray]:
    keep = bernoulli_mask(np, RandomKey(seed=0, tensor_id=rng_id, step=0), x.shape, None, keep_prob=1 - rate)
    return [np.where(keep, x / (1 - rate), 0.0)]


case(OpCase("dropout", _dropout(), _dropout_reference))


@st.composite
def _full(draw: st.DrawFn) -> Example:
    dtype = draw(st.sampled_from([DType.float64, DType.float32, DType.int64]))
    value = draw(st.sampled_from([0.0, -2.0, 3.0] + ([0.25] if dtype.is_floating else [])))
    return Example((), {"shape": draw(shapes()), "dtype": dtype, "value": value})


def _full_reference(shape: tuple[int, ...], dtype: DType, value: float) -> list[np.ndarray]:
    out = np.empty(shape, dtype=np.dtype(dtype.value))
    out[...] = value
    return [out]


case(OpCase("full", _full(), _full_reference, differentiable=()))
